// SumReduce / MaxReduce over one axis of a view: out[o, i] = reduce_r in[o, r, i] (o: the axes before, i: the axes
// after). ACC is the accumulator (float for floats, int/unsigned for integers; integers wrap as numpy's do).
// reduce_lanes: a warp per output, lanes striding r (the axis is innermost: coalesced reads); reduce_serial: a
// thread per output, r in order (the inner axes are innermost: neighbouring threads read neighbouring elements).
#pragma once

template <class ACC, int IS_MAX>
struct ReduceOf {
  LR_DEV ACC operator()(ACC a, ACC b) const { return IS_MAX ? MaxOp()(a, b) : SumOp()(a, b); }
};

template <class ACC, int IS_MAX, class Store, class Load>
LR_DEV void reduce_lanes(long long outputs, int r, ACC identity, Store store, Load load) {
  const int lane = threadIdx.x & 31;
  const long long warps = (long long)gridDim.x * (blockDim.x >> 5);
  ReduceOf<ACC, IS_MAX> op;
  for (long long w = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); w < outputs; w += warps) {
    ACC acc = identity;
    for (int k = lane; k < r; k += 32) acc = op(acc, load(w, k));
    acc = warp_reduce(acc, op);
    if (lane == 0) store(w, acc);
  }
}

template <class ACC, int IS_MAX, class Store, class Load>
LR_DEV void reduce_serial(long long outputs, int r, ACC identity, Store store, Load load) {
  ReduceOf<ACC, IS_MAX> op;
  for (long long w = (long long)blockIdx.x * blockDim.x + threadIdx.x; w < outputs;
       w += (long long)gridDim.x * blockDim.x) {
    ACC acc = identity;
    for (int k = 0; k < r; ++k) acc = op(acc, load(w, k));
    store(w, acc);
  }
}
