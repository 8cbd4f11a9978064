// Gather / Scatter helpers. An index outside [0, rows) is never followed: the element reads 0 (Gather) or is
// skipped (Scatter), and flag[0] is set so the host raises the reference's error after the node runs.
#pragma once

LR_DEV bool lr_index_ok(long long idx, long long rows, int* flag) {
  if (idx >= 0 && idx < rows) return true;
  atomicMax(flag, 1);
  return false;
}
