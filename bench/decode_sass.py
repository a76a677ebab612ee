"""The native engine's decode-attention kernel compiled for a GPU architecture on a machine without a GPU (Triton
and its bundled ptxas / nvdisasm only), and what its machine code does per KV tile:

    python -m bench.decode_sass [--fp8] [--shared] [--block-n 64] [--stages N] [--maxnreg N] [--arch 90]

Prints one JSON line: registers, stack bytes (spills), and the SASS instruction counts of each loop body (the
per-tile loop over cache positions; with --shared the prompt programs' loop too), by opcode. The shape is the
Qwen3-0.6B decode of the GSM8K recipe (head_dim 128, two query heads per KV head, RoPE and folded norms in the
kernel); stages and register cap default to rollout.triton_attention.tile_config's at the recipe's 640 rows.
A static count says how much work each tile costs the SMs (conversions, spills to local memory, address
arithmetic); only a GPU says how long it takes, so this guides kernel changes between GPU runs and is no timing.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile

LOOP_OPS = ("LDG", "LDS", "LDSM", "LDL", "STL", "F2F", "F2FP", "HMMA", "PRMT", "IMAD", "FMUL", "MUFU")


def compile_decode(*, fp8: bool, shared: bool, block_n: int, stages: int, maxnreg: int, arch: int):
    """-> (Triton's compiled kernel) for the recipe's shape."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from rollout import triton_attention as ta

    pointers = {"cache_ptr": "*fp8e4nv" if fp8 else "*bf16", "pos_ptr": "*i32", "scale_ptr": "*fp32",
                "ws_acc_ptr": "*fp32", "ws_ml_ptr": "*fp32"}
    pointers.update({n: "*i32" for n in ("row_prefix_ptr", "row_entry_ptr", "members_ptr", "group_len_ptr",
                                          "count_ptr")})
    const = dict(G=2, BLOCK_G=16, D=128, IEEE=False, ROPE=True, NORM=True, HID=1024, CHUNK=1024, CHUNK_M=256,
                 PREFIX=shared, MEMBERS=5, BLOCK_M=16, FP8=fp8, BLOCK_N=block_n)
    # the integer arguments' values at the recipe's shape (640 rows, 1,116-position slots): Triton's launcher
    # specializes each launch on them (a value of 1 becomes a constant, a multiple of 16 is marked divisible, as
    # is every pointer), which decides how wide the loads are, so the static compile must see the same
    slot, rows, hq, hkv, d = 1116, 640, 16, 8, 128
    ints = dict(s_qb=hq * d, s_qh=d, s_kb=(hq + 2 * hkv) * d, s_kh=d, s_vb=(hq + 2 * hkv) * d, s_vh=d, s_ob=hq * d,
                s_oh=d, s_rb=d, s_xb=1024, s_cv=(rows + 1) * hkv * slot * d, s_cb=hkv * slot * d, s_ch=slot * d,
                s_ct=d, s_sv=(rows + 1) * hkv * slot, s_sb=hkv * slot, s_sh=slot, s_st=1, s_wb=hq,
                s_half=rows * hq, s_mg=5, n_entries=128 if shared else 0)
    sig, attrs = {}, {}
    for i, name in enumerate(ta._decode_kernel.arg_names):
        if name in const or ints.get(name) == 1:
            sig[name] = "constexpr"
            const.setdefault(name, ints.get(name))
        elif name.endswith("_ptr"):
            sig[name] = pointers.get(name, "*bf16")
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "fp32" if name in ("qk_scale", "eps") else "i32"
            if name in ints and ints[name] % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    opts = {"num_warps": 4, "num_stages": stages} | ({"maxnreg": maxnreg} if maxnreg else {})
    return triton.compile(ASTSource(fn=ta._decode_kernel, signature=sig, constexprs=const, attrs=attrs),
                          target=GPUTarget("cuda", arch, 32), options=opts)


def loop_bodies(sass: str) -> list[dict[str, int]]:
    """Opcode counts of each loop body (a backward branch's target .. the branch), innermost (shortest) first."""
    labels, ins, pending = {}, [], None
    for line in sass.splitlines():
        m = re.match(r"\s*\.L_x_(\d+):", line)
        if m:
            pending = m.group(1)
            continue
        m = re.match(r"\s+/\*([0-9a-f]+)\*/\s+(.*?);", line)
        if m:
            addr = int(m.group(1), 16)
            if pending is not None:
                labels[pending], pending = addr, None
            ins.append((addr, m.group(2)))
    bodies = []
    for addr, text in ins:
        t = re.search(r"BRA\b.*?\.L_x_(\d+)", text)
        if t and labels.get(t.group(1), addr + 1) < addr:
            counts: dict[str, int] = {}
            for a, x in ins:
                if labels[t.group(1)] <= a <= addr:
                    op = (x.split()[1] if x.startswith("@") else x.split()[0]).split(".")[0]
                    counts[op] = counts.get(op, 0) + 1
            bodies.append({"instructions": sum(counts.values())} | {k: counts[k] for k in LOOP_OPS if k in counts})
    return sorted(bodies, key=lambda b: b["instructions"])


def analyse(compiled) -> dict:
    import triton

    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        usage = subprocess.run([os.path.join(tools, "cuobjdump"), "--dump-resource-usage", path],
                               capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([os.path.join(tools, "nvdisasm"), "-c", path], capture_output=True, text=True,
                              check=True).stdout
    return {"registers": int(re.search(r"REG:(\d+)", usage).group(1)),
            "stack_bytes": int(re.search(r"STACK:(\d+)", usage).group(1)),
            "shared_bytes": compiled.metadata.shared, "loops": loop_bodies(sass)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.decode_sass", description=__doc__.split("\n\n")[0])
    p.add_argument("--fp8", action="store_true", help="an fp8 (e4m3) KV cache with per-row scales")
    p.add_argument("--shared", action="store_true", help="the shared-prompt launch (prompt programs too)")
    p.add_argument("--block-n", type=int, default=64)
    p.add_argument("--stages", type=int, default=None, help="default: tile_config's at the recipe's shape")
    p.add_argument("--maxnreg", type=int, default=None, help="0: no register cap; default: tile_config's")
    p.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100/H200)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    a = parse_args(argv)
    from rollout.triton_attention import tile_config

    tile = tile_config(640, 1116, shared=a.shared, fp8=a.fp8)  # the recipe's decode launch
    a.stages = tile["num_stages"] if a.stages is None else a.stages
    a.maxnreg = tile.get("maxnreg", 0) if a.maxnreg is None else a.maxnreg
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton's default, without its warning
    out = {"bench": "decode_sass", "fp8": a.fp8, "shared": a.shared, "block_n": a.block_n, "stages": a.stages,
           "maxnreg": a.maxnreg, "arch": f"sm_{a.arch}"}
    out |= analyse(compile_decode(fp8=a.fp8, shared=a.shared, block_n=a.block_n, stages=a.stages,
                                  maxnreg=a.maxnreg, arch=a.arch))
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
