"""One tensor-parallel rank and how the ranks run together: the rank processes (workers.py) and
their process group (distributed.py), the model runner (runner.py: model + KV cache, execute a step,
sample), a step's wire format and layout (step_message.py, step_layout.py, sampled_ids.py), CUDA
graphs (cuda_graphs.py, piecewise.py), the dead-peer watch (error_watch.py) and the choice of TP
layers, stock or overlap over a symmetric heap (layer_factory.py).

A worker module may import `serving.model`, `serving.config` and the plugin (`tp_overlap_plugin`
layers, heap, kernels); never the engine or an entrypoint. The engine drives it through `Workers`
and `ModelRunner`.
"""
