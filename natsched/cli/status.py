"""``natsched status [--watch [SECONDS]] [--json]``: a terminal view of the cluster (:mod:`natsched.ops.status`)."""

from __future__ import annotations

from natsched.cli.options import connect, run, url_flag


def add_parsers(sub) -> None:
    st = sub.add_parser("status", help="show workers, tenants, queues and recent rejections",
                        description="A terminal view of the cluster: workers (state, load, KV use, hit ratio, "
                                    "heartbeat age), each tenant's floor / usage / cap, queue depths by class "
                                    "and recent rejections by reason.")
    url_flag(st)
    st.add_argument("--watch", nargs="?", type=float, const=2.0, default=None, metavar="SECONDS",
                    help="redraw every SECONDS (default 2) until Ctrl-C")
    st.add_argument("--json", action="store_true", help="print the view as JSON (once)")
    st.add_argument("--window", type=float, default=300.0, help="rejections and hit ratios over this many seconds")
    st.set_defaults(handler=cmd_status)


def cmd_status(args) -> int:
    from natsched.ops.status import StatusSettings, run_status

    settings = StatusSettings(window_s=args.window)
    if args.watch is not None and args.watch <= 0:
        return run(_refuse("--watch needs a positive number of seconds"))

    async def status() -> int:
        return await run_status(await connect(args, "natsched-status"), settings, args.watch, args.json)

    return run(status())


async def _refuse(message: str) -> int:
    raise ValueError(message)
