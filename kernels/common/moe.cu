// Mixture of experts: routing on the device, the grouped experts, the combine. The generic build
// (any GPU from sm_80); the kernels and their description are in moe.cuh, which
// kernels/sm90/moe.cu also includes (adding wgmma grouped-GEMM kernels on Hopper).
#include "moe.cuh"
