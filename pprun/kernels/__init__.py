"""The bottom floor of pprun's kernels: what the Triton kernels of ``pprun.attention``,
``pprun.layers`` and ``pprun.sampling`` share, so none of them imports another for it.

- :mod:`pprun.kernels.triton_utils`: interpreter detection, the no-FMA compile option,
  programmatic dependent launch (PDL).
- :mod:`pprun.kernels.grid`: a device's SM count and the arrival counters of in-kernel split
  merges.
- :mod:`pprun.kernels.partials`: a split-K matmul's unmerged partial sums (no Triton: CPU callers
  recognise and merge them too).

It imports nothing of pprun's above ``pprun.switches`` (``tests/test_imports.py`` holds the
layers).  Importing the package itself imports no submodule, so a CPU-only run that needs
:mod:`~pprun.kernels.partials` never imports Triton.
"""
