"""The routing benchmark's picture: TTFT CDF per policy, and hit ratio against the reuse ceiling.

matplotlib is an optional extra (``pip install 'natsched[bench]'``, or ``pip install matplotlib``);
:func:`require_matplotlib` says so before a long run starts rather than after it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

from natsched.sim.errors import PlotUnavailableError

INSTALL_HINT = "install it with: pip install 'natsched[bench]'  (or: pip install matplotlib)"


def require_matplotlib():
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no display
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotUnavailableError(f"--plot needs matplotlib, which is not installed; {INSTALL_HINT}") from None
    return plt


def plot_routing(path: str | Path, ttfts: Mapping[str, Sequence[float]], hit_ratios: Mapping[str, float],
                 ceiling: float, title: str, pooled: float | None = None) -> Path:
    """Write a PNG: left, the TTFT CDF of every policy (log x); right, hit ratio vs the reuse
    ceiling and (when given) what one LRU as large as all workers' KV would serve."""
    plt = require_matplotlib()
    path = Path(path)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [3, 2]})
    try:
        for name, values in ttfts.items():
            xs = sorted(v for v in values if v > 0)
            if not xs:
                continue
            n = len(xs)
            ax1.step(xs, [(i + 1) / n for i in range(n)], where="post", label=name)
        ax1.set_xscale("log")
        ax1.set_xlabel("time to first token (s, log scale)")
        ax1.set_ylabel("share of requests")
        ax1.set_ylim(0, 1.01)
        ax1.grid(True, which="both", alpha=0.3)
        ax1.legend(loc="lower right", fontsize="small")
        ax1.set_title("TTFT CDF")
        names = list(hit_ratios)
        bars = ax2.barh(names, [hit_ratios[n] for n in names], color="tab:blue")
        ax2.bar_label(bars, labels=[f"{hit_ratios[n]:.1%}" for n in names], padding=3, fontsize="small")
        ax2.axvline(ceiling, color="tab:red", linestyle="--", label=f"ceiling {ceiling:.1%}")
        if pooled is not None:
            ax2.axvline(pooled, color="tab:gray", linestyle=":", label=f"pooled LRU {pooled:.1%}")
        ax2.set_xlim(0, max(1e-9, max([ceiling, *hit_ratios.values()])) * 1.15)
        ax2.xaxis.set_major_formatter(lambda x, _: f"{x:.0%}")
        ax2.invert_yaxis()
        ax2.set_xlabel("prompt tokens served from cache")
        ax2.set_title("hit ratio vs the reuse ceiling")
        ax2.legend(loc="upper right", fontsize="small")
        fig.suptitle(title)
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
    return path
