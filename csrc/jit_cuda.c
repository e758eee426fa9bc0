/* CUDA JIT: NVRTC + the driver API, both opened with dlopen (see include/aotfuse/jit_cuda.h). */
#define _GNU_SOURCE
#include "aotfuse/jit_cuda.h"

#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "aotfuse/jit.h"

#define JIT_CUDA_VERSION "aotfuse-cuda-2" /* 2: --fmad=false */
#define MAX_DIRS 16
#define MAX_DEVICES 64

/* The few driver and NVRTC types used, by their ABI (no CUDA headers at build time). */
typedef int CUresult, nvrtcResult;
typedef int CUdevice;
typedef void *CUcontext, *CUmodule, *CUfunction, *CUstream, *nvrtcProgram;
enum { CU_ATTR_SM_COUNT = 16, CU_ATTR_CC_MAJOR = 75, CU_ATTR_CC_MINOR = 76 };
enum { CU_FUNC_ATTR_LOCAL_SIZE = 3, CU_FUNC_ATTR_NUM_REGS = 4 };

static struct {
    void *lib;
    char path[4096];
    int version;
    const char *(*GetErrorString)(nvrtcResult);
    nvrtcResult (*Version)(int *, int *);
    nvrtcResult (*GetNumSupportedArchs)(int *);
    nvrtcResult (*GetSupportedArchs)(int *);
    nvrtcResult (*CreateProgram)(nvrtcProgram *, const char *, const char *, int, const char *const *, const char *const *);
    nvrtcResult (*CompileProgram)(nvrtcProgram, int, const char *const *);
    nvrtcResult (*GetProgramLogSize)(nvrtcProgram, size_t *);
    nvrtcResult (*GetProgramLog)(nvrtcProgram, char *);
    nvrtcResult (*GetCUBINSize)(nvrtcProgram, size_t *);
    nvrtcResult (*GetCUBIN)(nvrtcProgram, char *);
    nvrtcResult (*GetPTXSize)(nvrtcProgram, size_t *);
    nvrtcResult (*GetPTX)(nvrtcProgram, char *);
    nvrtcResult (*DestroyProgram)(nvrtcProgram *);
} nv;

static struct {
    void *lib;
    CUresult (*Init)(unsigned);
    CUresult (*GetErrorString)(CUresult, const char **);
    CUresult (*DeviceGet)(CUdevice *, int);
    CUresult (*DeviceGetAttribute)(int *, int, CUdevice);
    CUresult (*DevicePrimaryCtxRetain)(CUcontext *, CUdevice);
    CUresult (*CtxGetCurrent)(CUcontext *);
    CUresult (*CtxPushCurrent)(CUcontext);
    CUresult (*CtxPopCurrent)(CUcontext *);
    CUresult (*ModuleLoadData)(CUmodule *, const void *);
    CUresult (*ModuleUnload)(CUmodule);
    CUresult (*ModuleGetFunction)(CUfunction *, CUmodule, const char *);
    CUresult (*LaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream,
                             void **, void **);
    CUresult (*FuncGetAttribute)(int *, int, CUfunction);
    CUcontext primary[MAX_DEVICES];
} cu;

static char search_dirs[MAX_DIRS][1024];
static int n_search_dirs;

struct af_cuda_module {
    CUmodule mod;
    int device;
};

int af_cuda_add_search_dir(const char *dir) {
    if (!dir) return af_error_set(AF_ERR_INVALID, "af_cuda_add_search_dir: NULL");
    for (int i = 0; i < n_search_dirs; i++)
        if (strcmp(search_dirs[i], dir) == 0) return AF_OK;
    if (n_search_dirs == MAX_DIRS || strlen(dir) >= sizeof search_dirs[0]) return AF_OK; /* ignored, not an error */
    snprintf(search_dirs[n_search_dirs++], sizeof search_dirs[0], "%s", dir);
    return AF_OK;
}

static int load_symbols(void *lib, const char *const *names, void **slots, int n, const char *what) {
    for (int i = 0; i < n; i++) {
        slots[i] = dlsym(lib, names[i]);
        if (!slots[i]) return af_error_set(AF_ERR_UNSUPPORTED, "%s has no %s (too old?)", what, names[i]);
    }
    return AF_OK;
}

/* libnvrtc opens libnvrtc-builtins.so.<version> by name at compile time; when it came from a
 * folder the loader does not search (a wheel's), load the builtins from that folder first. */
static void preload_builtins(const char *nvrtc_path) {
    const char *slash = strrchr(nvrtc_path, '/');
    if (!slash) return;
    char dir[4096];
    snprintf(dir, sizeof dir, "%.*s", (int)(slash - nvrtc_path), nvrtc_path);
    DIR *d = opendir(dir);
    if (!d) return;
    for (struct dirent *e; (e = readdir(d));) {
        if (strncmp(e->d_name, "libnvrtc-builtins.so.", 21) != 0) continue;
        char path[4400];
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        dlopen(path, RTLD_NOW | RTLD_GLOBAL); /* stays loaded; a failure shows at compile time */
    }
    closedir(d);
}

static int load_nvrtc(void) {
    if (nv.lib) return AF_OK;
    static const char *const names[] = {"libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"};
    void *lib = NULL;
    const char *env = getenv("AOTFUSE_NVRTC");
    char path[4096] = "";
    if (env && *env) {
        lib = dlopen(env, RTLD_NOW | RTLD_LOCAL);
        if (!lib) return af_error_set(AF_ERR_UNSUPPORTED, "AOTFUSE_NVRTC=%s cannot be loaded: %s", env, dlerror());
        snprintf(path, sizeof path, "%s", env);
    }
    for (size_t i = 0; !lib && i < sizeof names / sizeof names[0]; i++) {
        lib = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
        if (lib) snprintf(path, sizeof path, "%s", names[i]);
    }
    for (int d = 0; !lib && d < n_search_dirs; d++)
        for (size_t i = 0; !lib && i < sizeof names / sizeof names[0]; i++) {
            snprintf(path, sizeof path, "%s/%s", search_dirs[d], names[i]);
            if (access(path, R_OK) == 0) lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
        }
    if (!lib)
        return af_error_set(AF_ERR_UNSUPPORTED, "NVRTC (libnvrtc.so) was not found: install CUDA's NVRTC (pip install "
                            "nvidia-cuda-nvrtc, or the CUDA toolkit), or set AOTFUSE_NVRTC to the library's path; "
                            "AOTFUSE_BACKEND=aten runs without fused kernels");
    static const char *const syms[] = {"nvrtcGetErrorString", "nvrtcVersion", "nvrtcGetNumSupportedArchs", "nvrtcGetSupportedArchs",
                                       "nvrtcCreateProgram", "nvrtcCompileProgram", "nvrtcGetProgramLogSize", "nvrtcGetProgramLog",
                                       "nvrtcGetCUBINSize", "nvrtcGetCUBIN", "nvrtcGetPTXSize", "nvrtcGetPTX", "nvrtcDestroyProgram"};
    void *slots[sizeof syms / sizeof syms[0]];
    int st = load_symbols(lib, syms, slots, (int)(sizeof syms / sizeof syms[0]), path);
    if (st) {
        dlclose(lib);
        return st;
    }
    memcpy(&nv.GetErrorString, slots, sizeof slots);
    preload_builtins(path);
    int major = 0, minor = 0;
    nv.Version(&major, &minor);
    nv.version = major * 1000 + minor * 10;
    snprintf(nv.path, sizeof nv.path, "%s", path);
    nv.lib = lib;
    return AF_OK;
}

static int cu_fail(CUresult r, const char *call) {
    const char *msg = NULL;
    if (cu.GetErrorString) cu.GetErrorString(r, &msg);
    return af_error_set(AF_ERR_RUNTIME, "CUDA driver: %s failed: %s (%d)", call, msg ? msg : "unknown error", r);
}

static int load_driver(void) {
    if (cu.lib) return AF_OK;
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) lib = dlopen("libcuda.so", RTLD_NOW | RTLD_LOCAL);
    if (!lib) return af_error_set(AF_ERR_UNSUPPORTED, "the CUDA driver (libcuda.so.1) was not found: %s", dlerror());
    static const char *const syms[] = {"cuInit", "cuGetErrorString", "cuDeviceGet", "cuDeviceGetAttribute",
                                       "cuDevicePrimaryCtxRetain", "cuCtxGetCurrent", "cuCtxPushCurrent_v2", "cuCtxPopCurrent_v2",
                                       "cuModuleLoadData", "cuModuleUnload", "cuModuleGetFunction", "cuLaunchKernel",
                                       "cuFuncGetAttribute"};
    void *slots[sizeof syms / sizeof syms[0]];
    int st = load_symbols(lib, syms, slots, (int)(sizeof syms / sizeof syms[0]), "libcuda");
    if (st) {
        dlclose(lib);
        return st;
    }
    memcpy(&cu.Init, slots, sizeof slots);
    cu.lib = lib;
    CUresult r = cu.Init(0);
    if (r) {
        st = cu_fail(r, "cuInit");
        cu.lib = NULL;
        dlclose(lib);
        return st;
    }
    return AF_OK;
}

int af_cuda_load(int need_driver) {
    int st = load_nvrtc();
    if (st == AF_OK && need_driver) st = load_driver();
    return st;
}

const char *af_nvrtc_path(void) { return nv.lib ? nv.path : ""; }
int af_nvrtc_version(void) { return nv.version; }

static int nvrtc_fail(nvrtcResult r, const char *call) {
    return af_error_set(AF_ERR_RUNTIME, "NVRTC: %s failed: %s", call, nv.GetErrorString ? nv.GetErrorString(r) : "?");
}

int af_nvrtc_compile(const char *source, int arch, int ptx, int verbose, char **image, size_t *size, char **log) {
    if (!source || !image || !size) return af_error_set(AF_ERR_INVALID, "af_nvrtc_compile: NULL argument");
    *image = NULL;
    *size = 0;
    if (log) *log = NULL;
    int st = load_nvrtc();
    if (st) return st;
    nvrtcProgram prog = NULL;
    nvrtcResult r = nv.CreateProgram(&prog, source, "aotfuse_kernels.cu", 0, NULL, NULL);
    if (r) return nvrtc_fail(r, "nvrtcCreateProgram");
    char archopt[64];
    snprintf(archopt, sizeof archopt, "--gpu-architecture=%s_%d", ptx ? "compute" : "sm", arch);
    /* --fmad=false: a multiply and an add stay two roundings, as ATen's separate kernels, the C
     * backend (-ffp-contract=off) and the host emulation round them; the kernels are bound by memory */
    const char *opts[6] = {archopt, "--std=c++17", "-w", "--fmad=false", "--ptxas-options=-v", NULL};
    int nopts = ptx || !verbose ? 4 : 5;
    nvrtcResult cr = nv.CompileProgram(prog, nopts, opts);
    size_t log_size = 0;
    char *text = NULL;
    if (nv.GetProgramLogSize(prog, &log_size) == 0 && log_size > 1 && (text = malloc(log_size + 1))) {
        if (nv.GetProgramLog(prog, text)) text[0] = '\0';
        text[log_size] = '\0';
    }
    if (cr && nopts == 5) {
        /* with ptxas's report (-v) the log holds every kernel's figures but not ptxas's error
         * (`uses too much shared data`): the error is the quiet compile's */
        free(text);
        nv.DestroyProgram(&prog);
        return af_nvrtc_compile(source, arch, ptx, 0, image, size, log);
    }
    if (cr) {
        st = af_error_set(AF_ERR_UNSUPPORTED, "NVRTC could not compile the generated CUDA for %s_%d: %s\n%.1500s",
                          ptx ? "compute" : "sm", arch, nv.GetErrorString(cr), text ? text : "(no log)");
    } else {
        size_t n = 0;
        r = ptx ? nv.GetPTXSize(prog, &n) : nv.GetCUBINSize(prog, &n);
        char *buf = r == 0 ? malloc(n + 1) : NULL;
        if (r) st = nvrtc_fail(r, ptx ? "nvrtcGetPTXSize" : "nvrtcGetCUBINSize");
        else if (!buf) st = af_error_set(AF_ERR_NOMEM, "out of memory reading a compiled module");
        else if ((r = ptx ? nv.GetPTX(prog, buf) : nv.GetCUBIN(prog, buf))) st = nvrtc_fail(r, "nvrtcGetCUBIN");
        if (st) free(buf);
        else {
            buf[n] = '\0';
            *image = buf;
            *size = n;
        }
    }
    nv.DestroyProgram(&prog);
    if (log && st == AF_OK) *log = text;
    else free(text);
    return st;
}

int af_cuda_device_info(int device, int *arch, int *sm_count) {
    int st = af_cuda_load(1);
    if (st) return st;
    CUdevice dev;
    CUresult r = cu.DeviceGet(&dev, device);
    if (r) return cu_fail(r, "cuDeviceGet");
    int major = 0, minor = 0, sms = 0;
    if ((r = cu.DeviceGetAttribute(&major, CU_ATTR_CC_MAJOR, dev)) || (r = cu.DeviceGetAttribute(&minor, CU_ATTR_CC_MINOR, dev)) ||
        (r = cu.DeviceGetAttribute(&sms, CU_ATTR_SM_COUNT, dev)))
        return cu_fail(r, "cuDeviceGetAttribute");
    if (arch) *arch = major * 10 + minor;
    if (sm_count) *sm_count = sms;
    return AF_OK;
}

/* Makes the device's primary context (torch's) current; *pushed says whether to pop it after. */
static int ctx_enter(int device, int *pushed) {
    *pushed = 0;
    if (device < 0 || device >= MAX_DEVICES) return af_error_set(AF_ERR_INVALID, "CUDA device %d out of range", device);
    CUresult r;
    if (!cu.primary[device]) {
        CUdevice dev;
        if ((r = cu.DeviceGet(&dev, device))) return cu_fail(r, "cuDeviceGet");
        if ((r = cu.DevicePrimaryCtxRetain(&cu.primary[device], dev))) return cu_fail(r, "cuDevicePrimaryCtxRetain");
    }
    CUcontext cur = NULL;
    if ((r = cu.CtxGetCurrent(&cur))) return cu_fail(r, "cuCtxGetCurrent");
    if (cur == cu.primary[device]) return AF_OK;
    if ((r = cu.CtxPushCurrent(cu.primary[device]))) return cu_fail(r, "cuCtxPushCurrent");
    *pushed = 1;
    return AF_OK;
}

static void ctx_leave(int pushed) {
    CUcontext popped;
    if (pushed) cu.CtxPopCurrent(&popped);
}

/* Cache file: "AFCUDA1\n", the 16-hex-digit key, the image length (8 bytes, little endian), the image. */
static const char magic[8] = {'A', 'F', 'C', 'U', 'D', 'A', '1', '\n'};

static char *read_cached(const char *path, const char *key, size_t *size) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    char head[8 + 16 + 8];
    char *buf = NULL;
    if (fread(head, 1, sizeof head, f) == sizeof head && memcmp(head, magic, 8) == 0 && memcmp(head + 8, key, 16) == 0) {
        uint64_t n = 0;
        for (int i = 0; i < 8; i++) n |= (uint64_t)(unsigned char)head[24 + i] << (8 * i);
        if (n > 0 && n < ((uint64_t)1 << 31) && (buf = malloc((size_t)n + 1))) {
            if (fread(buf, 1, (size_t)n, f) != (size_t)n || fgetc(f) != EOF) {
                free(buf);
                buf = NULL;
            } else {
                buf[n] = '\0';
                *size = (size_t)n;
            }
        }
    }
    fclose(f);
    return buf;
}

static void write_cached(const char *dir, const char *path, const char *key, const char *image, size_t size) {
    char tmp[4200];
    snprintf(tmp, sizeof tmp, "%s/.%s.%ld.cubin", dir, key, (long)getpid());
    FILE *f = fopen(tmp, "wb");
    if (!f) return; /* a cache that cannot be written only costs a compile next time */
    unsigned char len[8];
    for (int i = 0; i < 8; i++) len[i] = (unsigned char)((uint64_t)size >> (8 * i));
    int ok = fwrite(magic, 1, 8, f) == 8 && fwrite(key, 1, 16, f) == 16 && fwrite(len, 1, 8, f) == 8 &&
             fwrite(image, 1, size, f) == size;
    ok &= fclose(f) == 0;
    if (!ok || rename(tmp, path) != 0) unlink(tmp);
}

/* The newest architecture NVRTC emits machine code for that the device runs, or -1 (PTX then). */
static int machine_code_arch(int arch, int *ptx_arch) {
    int n = 0, best = -1, newest = -1;
    if (nv.GetNumSupportedArchs(&n) || n <= 0 || n > 256) {
        *ptx_arch = arch;
        return arch; /* cannot ask: try the device's own */
    }
    int archs[256];
    if (nv.GetSupportedArchs(archs)) {
        *ptx_arch = arch;
        return arch;
    }
    for (int i = 0; i < n; i++) {
        if (archs[i] == arch) best = arch;
        if (archs[i] <= arch && archs[i] > newest) newest = archs[i];
    }
    *ptx_arch = newest > 0 ? newest : arch;
    return best;
}

int af_cuda_module_load(const char *source, int device, af_cuda_module **out, int *cache_hit) {
    if (!source || !out) return af_error_set(AF_ERR_INVALID, "af_cuda_module_load: NULL argument");
    int arch = 0, st = af_cuda_device_info(device, &arch, NULL);
    if (st) return st;
    int ptx_arch = arch, code_arch = machine_code_arch(arch, &ptx_arch), ptx = code_arch < 0;
    int target = ptx ? ptx_arch : code_arch;
    char dir[4000], key[32], what[64], path[4200];
    if ((st = af_jit_cache_dir(dir, sizeof dir))) return st;
    snprintf(what, sizeof what, "%s_%d nvrtc %d", ptx ? "compute" : "sm", target, nv.version);
    uint64_t h = af_jit_hash(14695981039346656037ull, JIT_CUDA_VERSION);
    h = af_jit_hash(h, source);
    h = af_jit_hash(h, what);
    snprintf(key, sizeof key, "%016" PRIx64, h);
    snprintf(path, sizeof path, "%s/%s.cubin", dir, key);
    size_t size = 0;
    char *image = read_cached(path, key, &size);
    int hit = image != NULL;
    if (!image && (st = af_nvrtc_compile(source, target, ptx, 0, &image, &size, NULL))) return st;
    af_cuda_module *m = calloc(1, sizeof *m);
    if (!m) {
        free(image);
        return af_error_set(AF_ERR_NOMEM, "out of memory loading a CUDA module");
    }
    m->device = device;
    int pushed = 0;
    if ((st = ctx_enter(device, &pushed)) == AF_OK) {
        CUresult r = cu.ModuleLoadData(&m->mod, image);
        if (r && hit) { /* a stale entry (another driver?): compile afresh once */
            free(image);
            image = NULL;
            hit = 0;
            if ((st = af_nvrtc_compile(source, target, ptx, 0, &image, &size, NULL)) == AF_OK) r = cu.ModuleLoadData(&m->mod, image);
        }
        if (st == AF_OK && r) st = cu_fail(r, "cuModuleLoadData");
        ctx_leave(pushed);
    }
    if (st == AF_OK && !hit) write_cached(dir, path, key, image, size);
    free(image);
    if (st) {
        free(m);
        return st;
    }
    if (cache_hit) *cache_hit = hit;
    *out = m;
    return AF_OK;
}

int af_cuda_function(af_cuda_module *m, const char *name, void **fn) {
    if (!m || !name || !fn) return af_error_set(AF_ERR_INVALID, "af_cuda_function: NULL argument");
    int pushed = 0, st = ctx_enter(m->device, &pushed);
    if (st) return st;
    CUresult r = cu.ModuleGetFunction((CUfunction *)fn, m->mod, name);
    ctx_leave(pushed);
    if (r) return af_error_set(AF_ERR_RUNTIME, "CUDA kernel %s is missing from its module (%d)", name, r);
    return AF_OK;
}

int af_cuda_launch_kernel(const af_cuda_module *m, void *fn, unsigned grid_x, unsigned grid_y, unsigned threads, void *stream,
                   void **params) {
    int pushed = 0, st = ctx_enter(m->device, &pushed);
    if (st) return st;
    CUresult r = cu.LaunchKernel((CUfunction)fn, grid_x, grid_y, 1, threads, 1, 1, 0, (CUstream)stream, params, NULL);
    ctx_leave(pushed);
    return r ? cu_fail(r, "cuLaunchKernel") : AF_OK;
}

int af_cuda_function_registers(void *fn, int *registers, int *local_bytes) {
    if (!cu.lib) return af_error_set(AF_ERR_UNSUPPORTED, "the CUDA driver is not loaded");
    CUresult r;
    if ((r = cu.FuncGetAttribute(registers, CU_FUNC_ATTR_NUM_REGS, (CUfunction)fn)) ||
        (r = cu.FuncGetAttribute(local_bytes, CU_FUNC_ATTR_LOCAL_SIZE, (CUfunction)fn)))
        return cu_fail(r, "cuFuncGetAttribute");
    return AF_OK;
}

void af_cuda_module_free(af_cuda_module *m) {
    if (!m) return;
    if (m->mod && cu.lib) {
        int pushed = 0;
        if (ctx_enter(m->device, &pushed) == AF_OK) {
            cu.ModuleUnload(m->mod);
            ctx_leave(pushed);
        }
    }
    free(m);
}
