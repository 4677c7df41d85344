"""Import shim for tokamax on the GPU machine: tokamax.benchmarking imports xprof.cli.tools.get_kernel_stats_tool
at module level but uses it only for timing_method='xprof'; peers.py times with CUDA events and tokamax's autotuner
uses CUPTI on GPUs. The real xprof wheel (32 MB, plus duckdb and google-cloud-storage) does not fit the carry limit."""
