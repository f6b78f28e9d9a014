#!/usr/bin/env bash
# On the GPU machine, in the repository's root, once per part as it
# arrives (the machine must stay up between the calls: the slices wait in
# /tmp/stash):
#
#   bash PART/unpack.sh PART        # PART = the carried part0, part1, ...
#
# part0 installs the wheels into /tmp/site; once every slice is there the
# archive is checked against its digest and unpacked here. Then run the
# benchmarks with PYTHONPATH=/tmp/site:/tmp/src (not the checkout: its
# clinfed folder is not the installed package's layout).
set -euo pipefail
part=$1
mkdir -p /tmp/stash
if [ -d "$part/wheels" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site "$part"/wheels/*.whl
    mkdir -p /tmp/src && cp -r "$part"/src/* /tmp/src/
fi
cp "$part"/archive.part* "$part/archive.sha256" /tmp/stash/
want=$(cat /tmp/stash/archive.sha256)
cat /tmp/stash/archive.part* > /tmp/archive.tar.xz
if [ "$(sha256sum /tmp/archive.tar.xz | cut -d' ' -f1)" = "$want" ]; then
    tar -xJf /tmp/archive.tar.xz && rm /tmp/archive.tar.xz && echo "unpacked (SHA-256 ${want:0:12})"
else
    rm /tmp/archive.tar.xz && echo "waiting for more slices ($(ls /tmp/stash/archive.part* | wc -l) here)"
fi
