/* A stand-in for the CUDA driver (libcuda) for tests/test_triton_launch_c.py: the calls autosel/ops/triton_launch/triton_launch.c
   makes, answering as a current context on device 0 would, and a cuLaunchKernel that records each launch and runs
   nothing. */

#include <stdint.h>
#include <string.h>

#define MAX_PARAMS 64

/* The test's stand-in for a loaded kernel: the one fact a driver knows of it that a launch does not pass. */
typedef struct { int n_params; } Kernel;

/* How many launches so far, and the last one's kernel, grid, block and parameters. */
int launches;
uint64_t kernel;
unsigned grid[3], block[3];
uint64_t params[MAX_PARAMS];

int cuCtxGetCurrent(void **context) {
    *context = (void *)1;
    return 0;
}

int cuCtxGetDevice(int *device) {
    *device = 0;
    return 0;
}

int cuGetErrorString(int error, const char **message) {
    *message = "the stand-in driver fails nothing";
    return 0;
}

int cuLaunchKernel(const Kernel *function, unsigned grid_x, unsigned grid_y, unsigned grid_z, unsigned block_x,
                   unsigned block_y, unsigned block_z, unsigned shared, void *stream, void **kernel_params,
                   void **extra) {
    launches++;
    kernel = (uint64_t)(uintptr_t)function;
    grid[0] = grid_x, grid[1] = grid_y, grid[2] = grid_z;
    block[0] = block_x, block[1] = block_y, block[2] = block_z;
    int n = function->n_params < MAX_PARAMS ? function->n_params : MAX_PARAMS;
    /* triton_launch.c passes every parameter from an 8-byte slot; the test keeps the bytes its kind passes. */
    for (int i = 0; i < n; i++) memcpy(&params[i], kernel_params[i], 8);
    return 0;
}
