#!/usr/bin/env bash
# Packs here what benchmarks/gpu_checks.sh needs on the device machine and its image lacks (it has torch, Lightning
# and pytest, and no network):
#   .whl/   torchao's wheel for the device's Python 3.12 (step 4, FP8)
#   .site/  omegaconf, antlr4 and hydra, pure Python, copied from this checkout's .venv (step 5: the cost model's
#           workers import lightning_deepseek.autotune, which reads Hydra configs)
# Both are kept out of git by .git/info/exclude. Then one device call (carry: .whl and .site):
#   python3 -m pip install -q --no-index --no-deps --target .site/whl .whl/*.whl &&
#     PYTHONPATH=$PWD/.site/whl:$PWD/.site bash benchmarks/gpu_checks.sh "$OUT"
set -euo pipefail
cd "$(dirname "$0")/.."
site=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
exclude=$(git rev-parse --git-path info/exclude)  # also right in a worktree, where .git is a file
mkdir -p "$(dirname "$exclude")" .whl .site
for path in /.whl/ /.site/; do grep -qxF "$path" "$exclude" 2>/dev/null || echo "$path" >>"$exclude"; done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux2014_x86_64 \
  -d .whl "torchao==$(.venv/bin/python -c 'import torchao; print(torchao.__version__)')"
for package in omegaconf antlr4 hydra; do rm -rf ".site/$package"; cp -r "$site/$package" .site/; done
du -sh .whl .site
