"""Simulator and benchmarks: replay traces through the objects the services ship, in virtual time.

- :mod:`sim.trace`        Mooncake JSONL traces -> requests with chained block hashes
- :mod:`sim.des`          the discrete-event simulator (RouterCore + one SimCore per worker)
- :mod:`sim.admission`    the pluggable admission hook (allow / queue / reject before routing)
- :mod:`sim.metrics`      per-request records and the benchmark metrics (incl. the reuse ceiling)
- :mod:`sim.calibrate`    the speed-up that yields a target busy fraction
- :mod:`sim.bench_routing` every routing policy side by side (``natsched bench routing``)
- :mod:`sim.plot`         the PNG (matplotlib, optional extra)
- :mod:`sim.progress`     a plain stderr progress line
- :mod:`sim.errors`       ``SimError`` and its subclasses
"""
