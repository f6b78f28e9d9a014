#!/usr/bin/env bash
# Pack what the benchmarks need for an offline GPU machine whose image has
# torch and transformers but not the rest, in parts small enough to carry
# one per call (a machine that takes at most ~60 MB a transfer).
#
#   benchmarks/gpu/pack.sh OUT PART_MB PATH...
#
# OUT/part0 holds the wheels (clinfed itself, opacus, dp-accounting,
# datasets, dill, multiprocess: Python 3.12, manylinux), seqeval's source
# (it ships no wheel), unpack.sh and the first slice of an xz archive of
# PATH... (a corpus work folder and its saved start, say); OUT/part1... the
# other slices; OUT/part*/archive.sha256 the whole archive's digest. Only
# public text belongs in PATH: the machine is someone else's.
set -euo pipefail
out=$1 part_mb=$2
shift 2
here=$(cd "$(dirname "$0")/../.." && pwd)
py=${PYTHON:-$here/.venv/bin/python}
rm -rf "$out" && mkdir -p "$out/part0/wheels"
"$py" -m pip wheel -q --no-deps --no-build-isolation -w "$out/part0/wheels" "$here"
version() { "$py" -c "import importlib.metadata as m; print(m.version('$1'))"; }
pins=()
for name in opacus dp-accounting datasets dill multiprocess; do pins+=("$name==$(version "$name")"); done
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    -d "$out/part0/wheels" "${pins[@]}"
seqeval=$("$py" -c "import seqeval, os; print(os.path.dirname(seqeval.__file__))")
mkdir -p "$out/part0/src" && cp -r "$seqeval" "$out/part0/src/"
find "$out/part0/src" -name __pycache__ -prune -exec rm -rf {} +
cp "$here/benchmarks/gpu/unpack.sh" "$out/part0/"
tar -cf - "$@" | xz -T0 -1 > "$out/archive.tar.xz"
digest=$(sha256sum "$out/archive.tar.xz" | cut -d' ' -f1)
split -b "${part_mb}M" -d -a 1 "$out/archive.tar.xz" "$out/archive.part"
rm "$out/archive.tar.xz"
for slice in "$out"/archive.part*; do
    n=${slice##*.part}
    mkdir -p "$out/part$n" && mv "$slice" "$out/part$n/" && echo "$digest" > "$out/part$n/archive.sha256"
done
du -sh "$out"/part*
