#!/usr/bin/env bash
# Prepares what `python -m benchmarks.gpu` needs on a GPU machine that can download nothing and
# has its own Python (3.12) with torch and Triton but not all of loraserve's packages:
#   .whl/            wheels of the packages that image lacks (redis, gguf), pure Python
#   .gpu-tokenizer/  the default model's tokenizer files (the benchmark's models are random)
# Both are ignored by git (.git/info/exclude) and travel as the device call's `carry`. Then run,
# in the repository root on that machine, the command this script prints.
set -euo pipefail
cd "$(dirname "$0")/.."
py=.venv/bin/python
for path in /.whl/ /.gpu-tokenizer/; do
  grep -qxF "$path" .git/info/exclude 2>/dev/null || echo "$path" >> .git/info/exclude
done
mkdir -p .whl .gpu-tokenizer
versions=$($py -c 'from importlib.metadata import version as v; print(" ".join(n + "==" + v(n) for n in ("redis", "gguf")))')
# shellcheck disable=SC2086
$py -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl $versions
model_dir=$($py -c 'from loraserve.models.loader import default_model_dir; print(default_model_dir())')
for name in tokenizer.json tokenizer_config.json chat_template.jinja generation_config.json config.json; do
  if [ -f "$model_dir/$name" ]; then cp "$model_dir/$name" .gpu-tokenizer/; fi
done
cat <<'CMD'
carry: [".whl", ".gpu-tokenizer"]; command:
set -o pipefail; python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 3; for d in kernels adapters api; do ln -sfn ../$d loraserve/$d; done; export LORASERVE_GPU_TOKENIZER=$PWD/.gpu-tokenizer PYTHONUNBUFFERED=1; timeout 450 python3 -m benchmarks.gpu --out $OUT --work /tmp/w 2>&1 | tee $OUT/log.txt
CMD
