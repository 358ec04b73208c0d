"""The `tp-overlap` command: the top floor (kernels < core < serving < tuning < cli).

The one place that imports argparse: each subcommand's module here declares its options and turns the
parsed arguments into the typed configs the code below takes (EngineConfig, ServerConfig,
BenchServeConfig, OfflineBenchConfig, SamplingParams, tuning's keywords). Nothing below imports this
package. The command itself is main.py's `main`; `python -m tp_overlap_plugin.cli` runs it.
"""
