#!/usr/bin/env bash
# scripts/unpack_bundle.py: a tar.xz like gpu_check.sh --bundle's unpacks with its modes, and a
# missing or broken file, or a member that would land outside DEST, exits 2 naming the file.
# usage: unpack_bundle_test.sh SCRIPT
set -u
script=$1
command -v xz > /dev/null || { echo "SKIP: no xz here"; exit 77; }
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
no() { echo "FAIL: $*"; exit 1; }

mkdir -p "$scratch/src/gpu_check_bundle/bin"
printf '#!/bin/sh\necho ran\n' > "$scratch/src/gpu_check_bundle/bin/prog"
chmod 755 "$scratch/src/gpu_check_bundle/bin/prog"
head -c 100000 /dev/urandom > "$scratch/src/gpu_check_bundle/blob"
tar -C "$scratch/src" -cf - gpu_check_bundle | xz -T2 > "$scratch/b.tar.xz"
mkdir "$scratch/out"
python3 "$script" "$scratch/b.tar.xz" "$scratch/out" || no "a good bundle did not unpack"
[[ $("$scratch/out/gpu_check_bundle/bin/prog") == ran ]] || no "the program lost its mode"
cmp -s "$scratch/src/gpu_check_bundle/blob" "$scratch/out/gpu_check_bundle/blob" ||
  no "a file changed on the way"

err=$(python3 "$script" "$scratch/missing.tar.xz" "$scratch/out" 2>&1)
[[ $? == 2 && $err == *"missing.tar.xz"* ]] || no "a missing bundle: $err"
head -c 5000 "$scratch/b.tar.xz" > "$scratch/cut.tar.xz"
err=$(python3 "$script" "$scratch/cut.tar.xz" "$scratch/out2" 2>&1)
[[ $? == 2 && $err == *"cut.tar.xz"* ]] || no "a cut bundle: $err"
# A member named ../escape lands outside DEST where Python has extraction filters: refused.
python3 - "$scratch" <<'PY'
import io, sys, tarfile
with tarfile.open(sys.argv[1] + "/evil.tar.xz", "w:xz") as t:
    data = b"x"
    info = tarfile.TarInfo("../escape")
    info.size = len(data)
    t.addfile(info, io.BytesIO(data))
PY
mkdir "$scratch/out3"
if python3 -c 'import tarfile, sys; sys.exit(0 if hasattr(tarfile, "data_filter") else 1)'; then
  err=$(python3 "$script" "$scratch/evil.tar.xz" "$scratch/out3" 2>&1)
  [[ $? == 2 && $err == *"evil.tar.xz"* ]] || no "a member outside DEST: $err"
  [[ -e $scratch/escape ]] && no "a member was written outside DEST"
fi
python3 "$script" 2> /dev/null && no "no arguments were accepted"
echo "unpack_bundle: ok"
