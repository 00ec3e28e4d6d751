"""Trace-driven simulator of a Strata cluster (DESIGN section 9; see benchmarks/README.md).

The simulator replays a request trace through the *real* decision code, with a cost model in
place of the model forward pass::

    trace.py          Mooncake records -> token-level requests (hash id -> T seeded tokens)
    engine.py         SimulatedEngine: the real EngineCore with a cost-model executor
    cost_model.py     HardwareProfile (profiles/*.json) -> step time of a batch and its copies
    agents.py         routing agents: Strata's Router (fed by KV events), the peers' base
    peers.py          peer policies from their published descriptions (own approximate state)
    prefix_tree.py    the peers' approximate prefix trees (and Ray's own, where it imports)
    simulator.py      discrete-event loop: arrivals, replica steps, delayed reports to routers
    metrics.py        hit rates, TTFT percentiles, load imbalance, throughput of one run
    runs.py           batches of runs: policies x sweep points x replicates, in parallel
    report.py         tables and plots of run records
    cli.py            ``python -m benchmarks simulate``
    calibrate.py      ``python -m benchmarks calibrate``: fit a profile to the real engine
    clairvoyant.py    a host retention bound that reads the trace's future (``--retention``)
    reuse.py          ``python -m benchmarks.sim.reuse``: how often a trace's blocks come back,
                      split by what a replica knows of them

Scenarios (``python -m benchmarks run NAME``): ``sim-acceptance`` (acceptance.py),
``sim-sweeps`` (sweeps_scenario.py), both on the configuration of scenarios.py;
``sim-vs-real`` (sim_vs_real.py); ``router-micro`` (router_micro.py).

Replicas, scheduler, KV cache manager and router are imported from ``replicas`` and
``router``; nothing here re-implements them.
"""
