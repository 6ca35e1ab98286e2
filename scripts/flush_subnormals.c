/* Preloaded into the SmolLM2 grid's pinned `llama` binary (scripts/smollm2_study.sh), built from
 * a commit before the binary flushed subnormal floats itself (topr_llama::subnormal): sets x86-64's
 * DAZ and FTZ bits (MXCSR bits 6 and 15) in the main thread before `main`, so that every thread
 * started afterwards, libtorch's included, inherits them. Only values below 1.2e-38 change; a
 * collapsing policy's probabilities below that had put the CPU on its slow path (REINFORCE's
 * steps 11 s -> about 200 s). Elsewhere than x86-64 it does nothing. */
#if defined(__x86_64__)
#include <xmmintrin.h>

__attribute__((constructor)) static void topr_flush_subnormals(void) {
    _mm_setcsr(_mm_getcsr() | 0x8040u);
}
#endif
