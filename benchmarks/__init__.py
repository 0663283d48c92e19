"""Side-by-side benchmark of torchrpc against ``torch.distributed.rpc``.

``python -m benchmarks`` runs the same workloads on both systems, one after the other,
each in its own freshly spawned worker processes on this machine, and prints a markdown table
of every metric for both with the ratio torchrpc / torch (``--json`` for the machine-readable
form). Run ``python -m benchmarks --help`` for the workloads and their options.

Layout:

* :mod:`.systems`   the systems, as tables of module names (imported only in workers);
* :mod:`.options`   sizes, iterations and limits;
* :mod:`.metrics`   metric names, units, directions and the issues' targets;
* :mod:`.workloads` the workloads, run inside the workers;
* :mod:`._worker`   a worker process's entry point;
* :mod:`.launcher`  spawning, supervising and killing one session's workers;
* :mod:`.runner`    all workloads on all systems;
* :mod:`.report`    JSON and markdown;
* :mod:`.cli`       the command line;
* :mod:`.chart`     the ratios of a report as an SVG;
* :mod:`.variants`  systems besides torch and torchrpc (a floor, torchrpc configured otherwise);
* :mod:`.segments`  the step-by-step timer of one call.

It lives beside the package, not in it (the installed ``torchrpc`` does not ship it): run
it from the repository root. It imports ``torch.distributed.rpc`` only by name, inside the
worker processes. ``python -m benchmarks chart REPORT.json -o chart.svg`` draws a saved
report; ``python -m benchmarks.segments`` times one small ``rpc_sync`` step by step.
"""

__all__: list[str] = []
