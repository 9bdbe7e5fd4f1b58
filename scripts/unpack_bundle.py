#!/usr/bin/env python3
"""Unpacks scripts/gpu_check.sh's bundle (a tar.xz) on the GPU machine, whose tar may lack xz:
python3's tarfile reads it through lzma.

  python3 scripts/unpack_bundle.py build-sm90/gpu_check_bundle.tar.xz /tmp

Exit status 0 once DEST/gpu_check_bundle holds it; 2 with one line naming the file otherwise.
"""
import sys
import tarfile


def main(argv):
    if len(argv) != 3:
        print("usage: unpack_bundle.py BUNDLE.tar.xz DEST", file=sys.stderr)
        return 2
    bundle, dest = argv[1], argv[2]
    try:
        with tarfile.open(bundle, "r:xz") as t:
            # The 'data' filter (Python 3.12, backported to 3.8.17+) refuses members that would
            # land outside DEST; older Pythons have no filters.
            if hasattr(tarfile, "data_filter"):
                t.extractall(dest, filter="data")
            else:
                t.extractall(dest)
    except (OSError, tarfile.TarError, EOFError) as e:
        print(f"unpack_bundle: {bundle}: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
