"""Simulator and benchmarks: replay traces through the objects the services ship, in virtual time.

- :mod:`natsched.sim.trace`        Mooncake JSONL traces -> requests with chained block hashes
- :mod:`natsched.sim.des`          the discrete-event simulator (RouterCore + one SimCore per worker)
- :mod:`natsched.sim.admission`    the pluggable admission hook (allow / queue / reject before routing)
- :mod:`natsched.sim.metrics`      per-request records and the benchmark metrics (incl. the reuse ceiling)
- :mod:`natsched.sim.calibrate`    the speed-up that yields a target busy fraction
- :mod:`natsched.sim.bench_routing` every routing policy side by side (``natsched bench routing``)
- :mod:`natsched.sim.plot`         the PNG (matplotlib, optional extra)
- :mod:`natsched.sim.progress`     a plain stderr progress line
- :mod:`natsched.sim.errors`       ``SimError`` and its subclasses
"""
