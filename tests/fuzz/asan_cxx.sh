#!/bin/sh
# A C++ compiler for the native CPU kernels' builder (dflash_kernels.cpu_native.build_library reads $CXX) that
# adds AddressSanitizer: `make fuzz-asan` points CXX here, DFLASH_CACHE at a fresh folder (the library's cache key
# includes the compiler's path, so these builds never mix with the normal ones) and preloads the ASan runtime.
exec "${ASAN_REAL_CXX:-g++}" "$@" -fsanitize=address -fno-omit-frame-pointer -g
