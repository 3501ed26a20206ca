/* A stand-in for libnvidia-ml.so.1 on a machine without a GPU, written for trainwatch's
 * tests from the signatures NVML documents (nvml.h): the functions the daemon's GPU probe
 * calls through the real nvidia-ml-py bindings, for one GPU.
 *
 * The GPU lists the pids written (one per line) in the file $TRAINWATCH_SHIM_PIDS as its
 * compute processes, 1 GiB each. Once the file $TRAINWATCH_SHIM_LOST exists the GPU has
 * "fallen off the bus": every per-device query returns NVML_ERROR_GPU_IS_LOST (15), as the
 * driver does after an Xid 79.
 *
 * Per-process utilisation (SM and memory busy percent) is read from $TRAINWATCH_SHIM_BUSY.
 *
 * Build: cc -shared -fPIC -o libnvidia-ml.so.1 nvml_shim.c
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define NVML_SUCCESS 0
#define NVML_ERROR_INVALID_ARGUMENT 2
#define NVML_ERROR_INSUFFICIENT_SIZE 7
#define NVML_ERROR_GPU_IS_LOST 15

typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
typedef struct { unsigned int version; unsigned long long total, reserved, free, used; } nvmlMemory_v2_t;
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId, computeInstanceId;
} nvmlProcessInfo_t;

static int the_device; /* the one handle */
static const unsigned long long GIB = 1ULL << 30;

static int lost(void) {
    const char *path = getenv("TRAINWATCH_SHIM_LOST");
    return path != NULL && access(path, F_OK) == 0;
}

static unsigned int pids(unsigned int *out, unsigned int room) {
    const char *path = getenv("TRAINWATCH_SHIM_PIDS");
    unsigned int n = 0, pid;
    FILE *f = path ? fopen(path, "r") : NULL;
    if (f == NULL) return 0;
    while (fscanf(f, "%u", &pid) == 1) {
        if (out != NULL && n < room) out[n] = pid;
        n++;
    }
    fclose(f);
    return n;
}

int nvmlInitWithFlags(unsigned int flags) { (void)flags; return NVML_SUCCESS; }
int nvmlInit_v2(void) { return NVML_SUCCESS; }
int nvmlShutdown(void) { return NVML_SUCCESS; }

const char *nvmlErrorString(int result) {
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    default: return "Unknown Error";
    }
}

int nvmlDeviceGetCount_v2(unsigned int *count) { *count = 1; return NVML_SUCCESS; }

int nvmlDeviceGetHandleByIndex_v2(unsigned int index, void **device) {
    if (index != 0) return NVML_ERROR_INVALID_ARGUMENT;
    *device = &the_device;
    return NVML_SUCCESS;
}

int nvmlDeviceGetName(void *device, char *name, unsigned int length) {
    (void)device;
    if (lost()) return NVML_ERROR_GPU_IS_LOST;
    snprintf(name, length, "%s", "trainwatch shim GPU");
    return NVML_SUCCESS;
}

int nvmlDeviceGetUUID(void *device, char *uuid, unsigned int length) {
    (void)device;
    if (lost()) return NVML_ERROR_GPU_IS_LOST;
    snprintf(uuid, length, "%s", "GPU-00000000-0000-0000-0000-000000000000");
    return NVML_SUCCESS;
}

int nvmlDeviceGetMemoryInfo(void *device, nvmlMemory_t *memory) {
    (void)device;
    if (lost()) return NVML_ERROR_GPU_IS_LOST;
    memory->total = 80 * GIB;
    memory->used = pids(NULL, 0) * GIB;
    memory->free = memory->total - memory->used;
    return NVML_SUCCESS;
}

int nvmlDeviceGetMemoryInfo_v2(void *device, nvmlMemory_v2_t *memory) {
    (void)device;
    if (lost()) return NVML_ERROR_GPU_IS_LOST;
    memory->total = 80 * GIB;
    memory->reserved = 0;
    memory->used = pids(NULL, 0) * GIB;
    memory->free = memory->total - memory->used;
    return NVML_SUCCESS;
}

int nvmlDeviceGetComputeRunningProcesses_v3(void *device, unsigned int *count, nvmlProcessInfo_t *infos) {
    unsigned int found[64], n, i;
    (void)device;
    if (lost()) return NVML_ERROR_GPU_IS_LOST;
    n = pids(found, 64);
    if (n > 64) n = 64;
    if (n == 0) { *count = 0; return NVML_SUCCESS; }
    if (infos == NULL || *count < n) { *count = n; return NVML_ERROR_INSUFFICIENT_SIZE; }
    for (i = 0; i < n; i++) {
        memset(&infos[i], 0, sizeof infos[i]);
        infos[i].pid = found[i];
        infos[i].usedGpuMemory = GIB;
    }
    *count = n;
    return NVML_SUCCESS;
}

/* Per-process utilisation: the file $TRAINWATCH_SHIM_BUSY holds "pid sm mem" lines; each
 * call returns one sample per line, stamped now (microseconds), as the driver does for a
 * process that ran kernels since lastSeenTimeStamp; no line, no sample (NOT_FOUND). */
typedef struct {
    unsigned int pid;
    unsigned long long timeStamp;
    unsigned int smUtil, memUtil, encUtil, decUtil;
} nvmlProcessUtilizationSample_t;

#define NVML_ERROR_NOT_FOUND 6
#include <sys/time.h>

int nvmlDeviceGetProcessUtilization(void *device, nvmlProcessUtilizationSample_t *samples,
                                    unsigned int *count, unsigned long long last) {
    const char *path = getenv("TRAINWATCH_SHIM_BUSY");
    unsigned int pid, sm, mem, n = 0;
    struct timeval tv;
    unsigned long long now;
    FILE *f;
    (void)device;
    if (lost()) return NVML_ERROR_GPU_IS_LOST;
    gettimeofday(&tv, NULL);
    now = (unsigned long long)tv.tv_sec * 1000000ULL + (unsigned long long)tv.tv_usec;
    f = path ? fopen(path, "r") : NULL;
    if (f != NULL) {
        while (fscanf(f, "%u %u %u", &pid, &sm, &mem) == 3) {
            if (samples != NULL && n < *count) {
                memset(&samples[n], 0, sizeof samples[n]);
                samples[n].pid = pid;
                samples[n].timeStamp = now > last ? now : last + 1;
                samples[n].smUtil = sm;
                samples[n].memUtil = mem;
            }
            n++;
        }
        fclose(f);
    }
    if (n == 0) return NVML_ERROR_NOT_FOUND;
    if (samples == NULL || *count < n) { *count = n; return NVML_ERROR_INSUFFICIENT_SIZE; }
    *count = n;
    return NVML_SUCCESS;
}
