/* Compiled as C99 with -pedantic by tests/ext/test_ext_build.py: the C ABI header must stay plain C. */
#include "dflash_kernels.h"

int main(void) { return dflash_kernels_abi_version() == DFLASH_KERNELS_ABI_VERSION ? 0 : 1; }
