"""Simulator and benchmarks: replay traces through the objects the services ship, in virtual time.

- :mod:`natsched.sim.trace`        Mooncake JSONL traces -> requests with chained block hashes
- :mod:`natsched.sim.des`          the discrete-event simulator (RouterCore + one SimCore per worker)
- :mod:`natsched.sim.admission`    the pluggable admission hook (allow / queue / reject before routing)
- :mod:`natsched.sim.metrics`      per-request records and the benchmark metrics (incl. the reuse ceiling)
- :mod:`natsched.sim.ideal`        the ideal cluster's TTFT per request (the floor of a TTFT headline)
- :mod:`natsched.sim.calibrate`    the speed-up that yields a target busy fraction
- :mod:`natsched.sim.bench_routing` every routing policy side by side (``natsched bench routing``)
- :mod:`natsched.sim.scenario`     scenario files (cluster + traffic + events + SLOs + headline), checked
- :mod:`natsched.sim.traffic`      generated scenario traffic (tenants, KB chunks, multi-turn sessions)
- :mod:`natsched.sim.contenders`   (admission, routing) pairs: natsched and each peer as documented
- :mod:`natsched.sim.bench_scenarios` the scenario suite (``natsched bench scenarios``)
- :mod:`natsched.sim.plot`         the PNG (matplotlib, optional extra)
- :mod:`natsched.sim.progress`     a plain stderr progress line
- :mod:`natsched.sim.errors`       ``SimError`` and its subclasses
"""
