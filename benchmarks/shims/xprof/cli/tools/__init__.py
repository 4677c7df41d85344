get_kernel_stats_tool = None  # see xprof/__init__.py
