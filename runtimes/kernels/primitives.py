"""The HLIR primitives as kernels: one ``KernelSpec`` per op of ``graph.core.PRIMITIVE_OPS`` (the one list of
primitives). Their semantics are ``graph.reference``'s; a naive Program (``Program.from_graph``) uses only these.
"""

from __future__ import annotations

from luminal_recipes.graph.core import BINARY_OPS, PRIMITIVE_OPS, REDUCE_OPS, UNARY_OPS

from .spec import Ctor, KernelCall, KernelSpec, Work

REFERENCE = "HLIR primitive; semantics of graph.reference"


def _source(k: KernelCall) -> Work:
    return Work(launches=0)  # bound or computed at load, not run


def _reduce(k: KernelCall) -> Work:
    return k.base(ew_flops=k.numel(k.inputs[0][0].shape))


def _scatter(k: KernelCall) -> Work:
    work = k.base()
    work.bytes += k.written  # the copy of the destination
    return work


def _gather(k: KernelCall) -> Work:
    # only the picked rows of the table are read (an embedding lookup, the experts a router chose), never the
    # whole table; rows picked twice are read twice at most
    rows = min(k.read(0), k.written)
    return Work(bytes=rows + k.read(1) + k.written, ew_flops=k.out_numel)


def _dequant(k: KernelCall) -> Work:
    # the packed bytes read once, the decoded values written; a few integer and float operations per value
    return k.base(ew_flops=3.0 * k.out_numel)


def _reduce_axis(literals, views) -> dict:
    # the e-graph counts reduction axes from the end of the operand (rules match trailing axes of any rank)
    return {"axis": len(views[0].shape) - 1 - literals["axis"]}


def _named_unary(op: str):
    def cost(k: KernelCall) -> Work:
        return k.base(ew_ops={op: k.out_numel})

    return cost


def _specs() -> list[KernelSpec]:
    specs: list[KernelSpec] = []
    for op in UNARY_OPS:
        specs.append(KernelSpec(op, REFERENCE, {op: Ctor("x:Ld")}, "x", cost=_named_unary(op),
                                elementwise_inplace=True, primitive=True))
    for op in BINARY_OPS:
        specs.append(KernelSpec(op, REFERENCE, {op: Ctor("a:Ld b:Ld")}, "a, b (same shape and dtype)",
                                elementwise_inplace=True, primitive=True))
    for op in REDUCE_OPS:
        specs.append(KernelSpec(op, REFERENCE, {op: Ctor("x:Ld axis:i64", attrs=_reduce_axis)}, "x",
                                {"axis": "the reduced axis (removed)"}, cost=_reduce, primitive=True))
    specs += [
        KernelSpec("Iota", REFERENCE, {"Iota": Ctor("n:Dim")}, "none; out i32 [n] = 0..n-1", primitive=True),
        KernelSpec("Gather", REFERENCE, {"Gather": Ctor("table:Ld index:Ld")}, "table [R, ...], index (i32)",
                   cost=_gather, primitive=True, version="2"),
        KernelSpec("Scatter", REFERENCE, {"Scatter": Ctor("dest:Ld index:Ld src:Ld")},
                   "dest [R, ...], index (i32) [n], src [n, ...]; out = a copy of dest with rows index <- src",
                   cost=_scatter, primitive=True),
        KernelSpec("Cast", REFERENCE, {"Cast": Ctor("dtype:String x:Ld", attrs=lambda literals, views: {})},
                   "x; out = x converted to the node's dtype", primitive=True),
        KernelSpec("Dequant", REFERENCE,
                   {"Dequant": Ctor("qtype:String dtype:String x:Ld",
                                    attrs=lambda literals, views: {"qtype": literals["qtype"]})},
                   "x u8 [..., row_bytes] (whole blocks per row); out [..., K] = the decoded values "
                   "(graph.gguf_blocks), computed in f32, converted to the node's dtype",
                   {"qtype": "the GGUF block type: F32 F16 BF16 Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q2_K Q3_K Q4_K Q5_K Q6_K "
                             "IQ4_NL IQ4_XS"},
                   cost=_dequant, primitive=True),
        KernelSpec("Constant", REFERENCE, {"Const": Ctor("dtype:String value:f64"),
                                           "ConstArr": Ctor("node:i64 values:String")},
                   "none", {"value": "a scalar (or the node's data: an array)"}, cost=_source, primitive=True),
        KernelSpec("Input", REFERENCE, {"Input": Ctor("name:String")}, "none",
                   {"name": "the input's name", "kind": "input | weight | state"}, cost=_source, primitive=True),
    ]
    assert sorted(s.name for s in specs) == sorted(PRIMITIVE_OPS), "one spec per primitive of graph.core"
    return specs


PRIMITIVES: list[KernelSpec] = _specs()
