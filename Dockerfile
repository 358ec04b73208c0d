# syntax=docker/dockerfile:1
#
# tp-overlap server image. ROCm (MI300X) by default, on AMD's PyTorch image:
#   docker build -t tp-overlap:rocm .
#   docker run --rm --network=host --ipc=host --device=/dev/kfd --device=/dev/dri --group-add video \
#       --security-opt seccomp=unconfined -v /models:/models \
#       tp-overlap:rocm serve --host 0.0.0.0 --model /models/Llama-3.1-70B --tp 8
#
# CUDA: the same file on a PyTorch CUDA base (a -devel tag: Triton compiles its launcher with gcc):
#   docker build --build-arg BASE_IMAGE=pytorch/pytorch:2.11.0-cuda13.0-cudnn9-devel -t tp-overlap:cuda .
#   docker run --rm --gpus all --ipc=host -p 8000:8000 tp-overlap:cuda serve --host 0.0.0.0
#
# The base must carry torch 2.11-2.14 (pyproject's range); check the tag against the registry when
# bumping it. --ipc=host: the symmetric heap and NCCL/RCCL share memory between the rank processes,
# and Docker's default /dev/shm (64 MB) is too small.

ARG BASE_IMAGE=rocm/pytorch:rocm7.11.0_ubuntu24.04_py3.12_pytorch_release_2.11.0
FROM ${BASE_IMAGE}

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /opt/tp-overlap

COPY pyproject.toml README.md ./
COPY tp_overlap_plugin ./tp_overlap_plugin
COPY kernels ./kernels
COPY serving ./serving

# The base image's torch and Triton are built for its GPU stack (on ROCm, Triton is the
# `pytorch-triton-rocm` distribution). A plain `pip install .[serve]` would pull torch/triton wheels
# from PyPI over them, so the package goes in without dependencies and the rest of its requirements
# (minus torch and triton) are installed from pyproject.toml.
RUN python -c "import torch, triton; print('base image: torch', torch.__version__, '/ triton', triton.__version__)" \
 && python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; reqs = p['dependencies'] + p['optional-dependencies']['serve']; print('\n'.join(r for r in reqs if not r.replace(' ', '').startswith(('torch>', 'torch=', 'torch<', 'triton>', 'triton=', 'triton<'))))" > /tmp/requirements.txt \
 && pip install -r /tmp/requirements.txt \
 && pip install --no-deps . \
 && python -c "import torch; v = tuple(int(x) for x in torch.__version__.split('+')[0].split('.')[:2]); assert (2, 11) <= v < (2, 15), f'torch {torch.__version__} is outside 2.11-2.14; pick another BASE_IMAGE'" \
 && python -c "import tp_overlap_plugin.serving.entrypoints.openai.api_server" \
 && tp-overlap serve --help > /dev/null \
 && rm /tmp/requirements.txt

EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]

ENTRYPOINT ["tp-overlap"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
