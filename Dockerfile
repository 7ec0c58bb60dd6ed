# The playbook on an NGC PyTorch image (torch, Triton and CUDA already inside).
# Releases from 25.08 on carry CUDA 13 and support Blackwell, DGX Station GB300 included;
# pick a newer one with --build-arg NGC_TAG=<yy.mm>-py3.
#   docker build -t kernel-dev-ft .
#   docker run --gpus all --ipc host -e HF_TOKEN -v $(pwd):/workspace -it kernel-dev-ft make run
ARG NGC_TAG=25.10-py3
FROM nvcr.io/nvidia/pytorch:${NGC_TAG}

WORKDIR /workspace
COPY requirements.txt /tmp/requirements.txt
RUN pip install --no-cache-dir -r /tmp/requirements.txt

COPY . /workspace
CMD ["make", "run"]
