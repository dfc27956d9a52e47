"""What the study's fork server does once, before it forks any run, so that no run repeats it: after importing
LightningCLI's modules (torch, Lightning, ltcx's command line; ``prestart.PRELOAD`` names them first), measure the
one-thread float32 matmul rate that ``MFUMonitor`` divides by (``measured_matmul_flops``, cached per process).

The one-thread rate is what a CPU study's runs use (``cpus_per_run: 1``); a run on more threads measures its own.
Measured here, it is taken before any run trains, the same figure for every run, where each run's own measurement
was taken while the others trained beside it.
"""

from ltcx.throughput import measured_matmul_flops

measured_matmul_flops(1)
