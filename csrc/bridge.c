/* The torch bridge (see include/aotfuse/bridge.h and docs/ARCHITECTURE.md).
 *
 * Two routes to torch:
 *   - the stable C shim (aoti_torch_*), found with dlsym in torch's libtorch_cpu after
 *     `import torch`, for tensor metadata; a Python tensor becomes a shim handle through
 *     torch_tensor_from_pyobject where torch exports it (2.14+), else through one batched
 *     call of torch._C._aoti.unsafe_alloc_void_ptrs_from_tensors;
 *   - the Python C API for extern ATen calls: the stable dispatcher (torch_call_dispatcher)
 *     cannot pass a Scalar in any torch release up to 2.14, and ATen graphs are full of them.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "aotfuse/bridge.h"

#include <dlfcn.h>
#include <inttypes.h>
#include <stdint.h>
#include <string.h>

/* ---- the C shim: our own prototypes (torch's headers are C++ only) ---- */

typedef int32_t aoti_error;
typedef void *aten_handle;

#define SHIM_FUNCTIONS(X)                                                                  \
    X(aoti_torch_get_data_ptr, aoti_error, (aten_handle, void **))                          \
    X(aoti_torch_get_dim, aoti_error, (aten_handle, int64_t *))                             \
    X(aoti_torch_get_sizes, aoti_error, (aten_handle, int64_t **))                          \
    X(aoti_torch_get_strides, aoti_error, (aten_handle, int64_t **))                        \
    X(aoti_torch_get_storage_offset, aoti_error, (aten_handle, int64_t *))                  \
    X(aoti_torch_get_dtype, aoti_error, (aten_handle, int32_t *))                           \
    X(aoti_torch_get_device_type, aoti_error, (aten_handle, int32_t *))                     \
    X(aoti_torch_get_device_index, aoti_error, (aten_handle, int32_t *))                    \
    X(aoti_torch_delete_tensor_object, aoti_error, (aten_handle))                           \
    X(aoti_torch_new_tensor_handle, aoti_error, (aten_handle, aten_handle *))               \
    X(aoti_torch_empty_strided, aoti_error,                                                 \
      (int64_t, const int64_t *, const int64_t *, int32_t, int32_t, int32_t, aten_handle *)) \
    X(aoti_torch_dtype_float32, int32_t, (void))                                            \
    X(aoti_torch_dtype_float64, int32_t, (void))                                            \
    X(aoti_torch_dtype_float16, int32_t, (void))                                            \
    X(aoti_torch_dtype_bfloat16, int32_t, (void))                                           \
    X(aoti_torch_dtype_int64, int32_t, (void))                                              \
    X(aoti_torch_dtype_int32, int32_t, (void))                                              \
    X(aoti_torch_dtype_int16, int32_t, (void))                                              \
    X(aoti_torch_dtype_int8, int32_t, (void))                                               \
    X(aoti_torch_dtype_uint8, int32_t, (void))                                              \
    X(aoti_torch_dtype_bool, int32_t, (void))                                               \
    X(aoti_torch_dtype_complex64, int32_t, (void))                                          \
    X(aoti_torch_dtype_complex128, int32_t, (void))                                         \
    X(aoti_torch_device_type_cpu, int32_t, (void))                                          \
    X(aoti_torch_device_type_cuda, int32_t, (void))                                         \
    X(aoti_torch_device_type_meta, int32_t, (void))                                         \
    X(torch_call_dispatcher, aoti_error, (const char *, const char *, uint64_t *, uint64_t)) \
    X(torch_tensor_from_pyobject, aoti_error, (void *, aten_handle *))

/* The ones the bridge cannot work without; the rest are optional or looked up for the
 * record (bridge_info), to be used by later stages. */
#define SHIM_REQUIRED_COUNT 9

static struct {
#define X(name, ret, args) ret(*name) args;
    SHIM_FUNCTIONS(X)
#undef X
} shim;

static const char *const shim_names[] = {
#define X(name, ret, args) #name,
    SHIM_FUNCTIONS(X)
#undef X
};
#define SHIM_COUNT ((int)(sizeof shim_names / sizeof shim_names[0]))

/* torch's codes for our enums, read from the shim at init */
static int32_t torch_dtype_code[AF_DTYPE_COUNT];
static int32_t torch_device_code[AF_DEVICE_COUNT];

/* ---- Python objects resolved once ---- */

static struct {
    int ready;
    PyObject *torch;
    PyObject *ops;                  /* torch.ops */
    PyTypeObject *tensor_type;      /* torch.Tensor */
    PyObject *dtypes[AF_DTYPE_COUNT];
    PyObject *device_ctor;          /* torch.device */
    PyObject *handles_from_tensors; /* torch._C._aoti.unsafe_alloc_void_ptrs_from_tensors */
    PyObject *storage_use_count;    /* torch._C._storage_Use_Count (af_obj_sole_owner), looked up once */
    PyObject *empty_strided;        /* torch.empty_strided */
    PyObject *raw_stream;           /* torch._C._cuda_getCurrentRawStream, looked up at first use */
    PyObject *get_num_threads;      /* torch.get_num_threads, looked up at first use */
    PyObject *reinterpret;          /* torch._C._dynamo.guards._reinterpret_tensor, looked up at first use */
    int reinterpret_looked_up;
    /* torch._C._dynamo.guards._empty_strided_cpu/_cuda(sizes, strides, dtype): what inductor's
     * generated code allocates with, half torch.empty_strided's host time (the CUDA one on the
     * current device, torch._C._cuda_getDevice()); looked up at first use, NULL if absent */
    PyObject *empty_cpu, *empty_cuda, *cuda_get_device;
    int empty_looked_up;
    PyObject *variable_functions; /* torch._C._VariableFunctions (fast_bindings), looked up at first use */
} py;

static int bridge_fail(const char *what) {
    /* turn a pending Python error into a bridge error with its text */
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyObject *s = value ? PyObject_Str(value) : NULL;
    const char *msg = s ? PyUnicode_AsUTF8(s) : NULL;
    int st = af_error_set(AF_ERR_BRIDGE, "torch bridge: %s%s%s", what, msg ? ": " : "", msg ? msg : "");
    Py_XDECREF(s);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
    PyErr_Clear();
    return st;
}

static int load_shim(void) {
    PyObject *os_path = NULL, *dir = NULL, *file = NULL;
    int st = AF_OK;
    void *lib = NULL;
    /* torch/lib/libtorch_cpu.so, already loaded by `import torch`: RTLD_NOLOAD finds it */
    file = PyObject_GetAttrString(py.torch, "__file__");
    os_path = PyImport_ImportModule("os.path");
    if (!file || !os_path) {
        st = bridge_fail("cannot locate torch's library folder");
        goto done;
    }
    dir = PyObject_CallMethod(os_path, "dirname", "O", file);
    const char *d = dir ? PyUnicode_AsUTF8(dir) : NULL;
    if (!d) {
        st = bridge_fail("cannot locate torch's library folder");
        goto done;
    }
    static const char *const libs[] = {"libtorch_cpu.so", "libtorch.so", "libtorch_cpu.dylib", "libtorch.dylib"};
    char path[4096];
    for (size_t i = 0; i < sizeof libs / sizeof libs[0] && !lib; i++) {
        snprintf(path, sizeof path, "%s/lib/%s", d, libs[i]);
        lib = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
        if (lib && !dlsym(lib, "aoti_torch_get_sizes")) {
            dlclose(lib);
            lib = NULL;
        }
    }
    if (!lib) lib = dlopen(NULL, RTLD_NOW); /* statically linked or preloaded torch */
    if (!lib) {
        st = af_error_set(AF_ERR_BRIDGE, "torch bridge: libtorch_cpu is not loaded (import torch first)");
        goto done;
    }
    void **slots = (void **)&shim;
    for (int i = 0; i < SHIM_COUNT; i++) slots[i] = dlsym(lib, shim_names[i]);
    for (int i = 0; i < SHIM_REQUIRED_COUNT; i++)
        if (!slots[i]) {
            st = af_error_set(AF_ERR_BRIDGE, "torch bridge: torch does not export %s (torch too old?)", shim_names[i]);
            goto done;
        }
    /* lib stays open for the life of the process: torch is never unloaded */
    {
        int32_t (*const getters[AF_DTYPE_COUNT])(void) = {
            shim.aoti_torch_dtype_float32, shim.aoti_torch_dtype_float64, shim.aoti_torch_dtype_float16,
            shim.aoti_torch_dtype_bfloat16, shim.aoti_torch_dtype_int64, shim.aoti_torch_dtype_int32,
            shim.aoti_torch_dtype_int16, shim.aoti_torch_dtype_int8, shim.aoti_torch_dtype_uint8,
            shim.aoti_torch_dtype_bool, shim.aoti_torch_dtype_complex64, shim.aoti_torch_dtype_complex128,
            NULL /* uint64: c10's code */};
        /* c10::ScalarType's values, for a torch that lacks a getter (UInt64 is 29 since torch 2.3) */
        static const int32_t c10_codes[AF_DTYPE_COUNT] = {6, 7, 5, 15, 4, 3, 2, 1, 0, 11, 9, 10, 29};
        for (int i = 0; i < AF_DTYPE_COUNT; i++) torch_dtype_code[i] = getters[i] ? getters[i]() : c10_codes[i];
    }
    torch_device_code[AF_DEVICE_CPU] = shim.aoti_torch_device_type_cpu ? shim.aoti_torch_device_type_cpu() : 0;
    torch_device_code[AF_DEVICE_CUDA] = shim.aoti_torch_device_type_cuda ? shim.aoti_torch_device_type_cuda() : 1;
    torch_device_code[AF_DEVICE_META] = shim.aoti_torch_device_type_meta ? shim.aoti_torch_device_type_meta() : 14;
done:
    Py_XDECREF(os_path);
    Py_XDECREF(dir);
    Py_XDECREF(file);
    return st;
}

int af_bridge_init(void) {
    if (py.ready) return AF_OK;
    py.torch = PyImport_ImportModule("torch");
    if (!py.torch) return bridge_fail("import torch failed");
    py.ops = PyObject_GetAttrString(py.torch, "ops");
    PyObject *tensor = PyObject_GetAttrString(py.torch, "Tensor");
    py.device_ctor = PyObject_GetAttrString(py.torch, "device");
    py.empty_strided = PyObject_GetAttrString(py.torch, "empty_strided");
    if (!py.ops || !tensor || !py.device_ctor || !py.empty_strided || !PyType_Check(tensor)) {
        Py_XDECREF(tensor);
        return bridge_fail("torch.ops, torch.Tensor or torch.device missing");
    }
    py.tensor_type = (PyTypeObject *)tensor;
    for (int i = 0; i < AF_DTYPE_COUNT; i++) {
        py.dtypes[i] = PyObject_GetAttrString(py.torch, af_dtype_name(i));
        if (!py.dtypes[i]) return bridge_fail("a torch dtype is missing");
    }
    int st = load_shim();
    if (st) return st;
    if (!shim.torch_tensor_from_pyobject) {
        PyObject *aoti = PyImport_ImportModule("torch._C._aoti");
        if (aoti) py.handles_from_tensors = PyObject_GetAttrString(aoti, "unsafe_alloc_void_ptrs_from_tensors");
        Py_XDECREF(aoti);
        if (!py.handles_from_tensors)
            return bridge_fail("neither torch_tensor_from_pyobject nor torch._C._aoti.unsafe_alloc_void_ptrs_from_tensors");
    }
    py.ready = 1;
    return AF_OK;
}

int af_bridge_shim_count(void) { return SHIM_COUNT; }
const char *af_bridge_shim_name(int i) { return (i >= 0 && i < SHIM_COUNT) ? shim_names[i] : NULL; }
int af_bridge_shim_found(int i) {
    if (i < 0 || i >= SHIM_COUNT) return 0;
    return ((void **)&shim)[i] != NULL;
}

void af_obj_retain(af_obj *o) { Py_XINCREF((PyObject *)o); }
void af_obj_release(af_obj *o) { Py_XDECREF((PyObject *)o); }

/* ---- externs ---- */

struct af_extern {
    const af_graph *graph;
    const af_node *node_ref; /* re-read through graph each call: node arrays may move */
    int32_t node_index;
    PyObject *fn;            /* the OpOverload's C callable */
    int32_t n_pos;           /* positional arguments come first in node->args */
    PyObject **pos_const;    /* per positional arg: its constant, or NULL if it holds values */
    PyObject *args_const;    /* the whole tuple, when no positional arg holds a value */
    PyObject *kwargs_const;  /* the kwargs dict, when no keyword arg holds a value */
    int kw_dynamic;          /* some keyword arg holds a value */
    int may_alias;           /* its schema annotates an alias (a view, or a mutated argument) */
    PyObject *out_fn;        /* its out= overload's C callable (same arguments, then one written tensor), or NULL */
    PyObject *out_kw;        /* that written argument's name */
    PyObject *kwargs_into;   /* the out= call's kwargs when no keyword arg holds a value (out_kw set per call) */
};

static int arg_has_value(const af_arg *a) {
    if (a->kind == AF_ARG_VALUE) return 1;
    if (a->kind == AF_ARG_LIST)
        for (int32_t i = 0; i < a->u.list.n; i++)
            if (arg_has_value(&a->u.list.items[i])) return 1;
    return 0;
}

/* Converts an argument into a new Python reference; values come from `values`
 * (NULL while building constants, when no value may occur). */
static PyObject *arg_to_py(const af_arg *a, af_obj *const *values) {
    switch (a->kind) {
    case AF_ARG_VALUE: {
        PyObject *o = values ? (PyObject *)values[a->u.value] : NULL;
        if (!o) {
            PyErr_Format(PyExc_RuntimeError, "aotfuse runtime: value %d read before it was computed", (int)a->u.value);
            return NULL;
        }
        Py_INCREF(o);
        return o;
    }
    case AF_ARG_NONE: Py_RETURN_NONE;
    case AF_ARG_BOOL: return PyBool_FromLong((long)a->u.i);
    case AF_ARG_INT: return PyLong_FromLongLong(a->u.i);
    case AF_ARG_FLOAT: return PyFloat_FromDouble(a->u.f);
    case AF_ARG_COMPLEX: return PyComplex_FromDoubles(a->u.c.re, a->u.c.im);
    case AF_ARG_STR: return PyUnicode_FromString(a->u.s);
    case AF_ARG_DTYPE: Py_INCREF(py.dtypes[a->u.dtype]); return py.dtypes[a->u.dtype];
    case AF_ARG_DEVICE:
        if (a->u.device.index >= 0)
            return PyObject_CallFunction(py.device_ctor, "si", af_device_type_name(a->u.device.type), (int)a->u.device.index);
        return PyObject_CallFunction(py.device_ctor, "s", af_device_type_name(a->u.device.type));
    case AF_ARG_LAYOUT:
    case AF_ARG_MEMORY_FORMAT: return PyObject_GetAttrString(py.torch, a->u.s);
    case AF_ARG_LIST: {
        PyObject *list = PyList_New(a->u.list.n);
        if (!list) return NULL;
        for (int32_t i = 0; i < a->u.list.n; i++) {
            PyObject *item = arg_to_py(&a->u.list.items[i], values);
            if (!item) {
                Py_DECREF(list);
                return NULL;
            }
            PyList_SET_ITEM(list, i, item);
        }
        return list;
    }
    default: PyErr_SetString(PyExc_RuntimeError, "aotfuse runtime: bad argument kind"); return NULL;
    }
}

/* An OpOverload's schema's "arguments" or "returns" as a fast sequence (new reference), or NULL
 * (no error left set). */
static PyObject *schema_list(PyObject *op, const char *which) {
    PyObject *schema = PyObject_GetAttrString(op, "_schema");
    PyObject *list = schema ? PyObject_GetAttrString(schema, which) : NULL;
    PyObject *fast = list ? PySequence_Fast(list, "a schema's arguments") : NULL;
    Py_XDECREF(list);
    Py_XDECREF(schema);
    if (!fast) PyErr_Clear();
    return fast;
}

/* Whether an OpOverload's schema annotates an alias anywhere (a return viewing an argument, a
 * mutated argument): 1 also when it has no readable schema. */
static int schema_may_alias(PyObject *op) {
    static const char *const lists[2] = {"returns", "arguments"};
    int aliases = 0;
    for (int l = 0; l < 2 && !aliases; l++) {
        PyObject *fast = schema_list(op, lists[l]);
        aliases = fast == NULL;
        for (Py_ssize_t i = 0; fast && i < PySequence_Fast_GET_SIZE(fast) && !aliases; i++) {
            PyObject *info = PyObject_GetAttrString(PySequence_Fast_GET_ITEM(fast, i), "alias_info");
            aliases = info != Py_None;
            Py_XDECREF(info);
        }
        Py_XDECREF(fast);
    }
    PyErr_Clear();
    return aliases;
}

/* Whether argument objects a and b have equal names and types (str of their `type`): an overload of
 * the same names may take another type there (sum.DimnameList_out's `str[1] dim` beside
 * IntList_out's `int[1]? dim`, add.out's `Tensor other` beside Scalar_out's `Scalar other`). */
static int same_arg(PyObject *a, PyObject *b) {
    int eq = 0;
    static const char *const attrs[2] = {"name", "type"};
    for (int i = 0; i < 2; i++) {
        PyObject *x = PyObject_GetAttrString(a, attrs[i]), *y = PyObject_GetAttrString(b, attrs[i]);
        PyObject *xs = x && i ? PyObject_Str(x) : NULL, *ys = y && i ? PyObject_Str(y) : NULL;
        eq = i ? xs && ys && PyObject_RichCompareBool(xs, ys, Py_EQ) == 1
               : x && y && PyObject_RichCompareBool(x, y, Py_EQ) == 1;
        Py_XDECREF(xs);
        Py_XDECREF(ys);
        Py_XDECREF(x);
        Py_XDECREF(y);
        if (!eq) break;
    }
    PyErr_Clear();
    return eq;
}

/* The out= overload of op in packet: the same arguments (by name and type, in order) and then one
 * keyword-only tensor it writes; its C callable with *kw the keyword's name, or NULL. Only for an
 * op returning one tensor and annotating no alias. */
static PyObject *resolve_out_variant(PyObject *packet, PyObject *op, PyObject **kw) {
    PyObject *found = NULL, *fargs = schema_list(op, "arguments"), *rets = schema_list(op, "returns");
    PyObject *names = packet ? PyObject_CallMethod(packet, "overloads", NULL) : NULL;
    PyObject *fnames = names ? PySequence_Fast(names, "overloads") : NULL;
    int one_tensor = 0;
    if (rets && PySequence_Fast_GET_SIZE(rets) == 1) {
        PyObject *type = PyObject_GetAttrString(PySequence_Fast_GET_ITEM(rets, 0), "type");
        PyObject *str = type ? PyObject_Str(type) : NULL;
        one_tensor = str && PyUnicode_CompareWithASCIIString(str, "Tensor") == 0;
        Py_XDECREF(str);
        Py_XDECREF(type);
    }
    Py_ssize_t nf = fargs ? PySequence_Fast_GET_SIZE(fargs) : -1;
    for (Py_ssize_t i = 0; one_tensor && fargs && fnames && !found && i < PySequence_Fast_GET_SIZE(fnames); i++) {
        PyObject *cand = PyObject_GetAttr(packet, PySequence_Fast_GET_ITEM(fnames, i));
        PyObject *cargs = cand ? schema_list(cand, "arguments") : NULL;
        int ok = cargs && PySequence_Fast_GET_SIZE(cargs) == nf + 1;
        for (Py_ssize_t k = 0; ok && k < nf; k++) ok = same_arg(PySequence_Fast_GET_ITEM(fargs, k), PySequence_Fast_GET_ITEM(cargs, k));
        if (ok) {
            PyObject *last = PySequence_Fast_GET_ITEM(cargs, nf), *info = PyObject_GetAttrString(last, "alias_info");
            PyObject *write = info && info != Py_None ? PyObject_GetAttrString(info, "is_write") : NULL;
            PyObject *kwonly = PyObject_GetAttrString(last, "kwarg_only");
            ok = write == Py_True && kwonly == Py_True;
            Py_XDECREF(write);
            Py_XDECREF(info);
            Py_XDECREF(kwonly);
            PyObject *c_op = ok ? PyObject_GetAttrString(cand, "_op") : NULL;
            if (c_op && PyCallable_Check(c_op) && (*kw = PyObject_GetAttrString(last, "name")) && PyUnicode_Check(*kw)) {
                PyUnicode_InternInPlace(kw);
                found = c_op;
                c_op = NULL;
            } else {
                Py_CLEAR(*kw);
            }
            Py_XDECREF(c_op);
        }
        Py_XDECREF(cargs);
        Py_XDECREF(cand);
        PyErr_Clear();
    }
    Py_XDECREF(fnames);
    Py_XDECREF(names);
    Py_XDECREF(rets);
    Py_XDECREF(fargs);
    PyErr_Clear();
    return found;
}

/* ATen overloads whose torch.<name> binding (torch._C._VariableFunctions) takes the schema's
 * positional arguments in their order and its keyword-only ones by the same names, resolves to that
 * overload for them, and takes out= where the overload has an out= variant named `out`. The binding
 * parses its arguments in C++ and calls the op unboxed: 0.4-1 us a call less than the overload's
 * boxed `_op` (1 thread: mm 1.36 against 1.81 us, addmm 2.29 against 3.18, sum 1.47 against 2.46),
 * which the host-bound steps of a training step (hundreds of ATen calls) feel. Where the binding
 * takes no out= (or the out= variant names its written argument otherwise), out= calls keep the
 * out= overload's own callable.
 * tests/test_bridge_bindings.py checks each against the overload, plain and out=. */
static const struct {
    const char *op, *binding;
    int out; /* the binding takes out= for the overload's out= variant (whose written argument is `out`) */
} fast_bindings[] = {
    {"aten::mm.default", "mm", 1},
    {"aten::addmm.default", "addmm", 1},
    {"aten::bmm.default", "bmm", 1},
    {"aten::baddbmm.default", "baddbmm", 1},
    {"aten::sum.dim_IntList", "sum", 1},
    {"aten::mean.dim", "mean", 1},
    {"aten::amax.default", "amax", 1},
    {"aten::_softmax.default", "_softmax", 1},
    {"aten::_log_softmax.default", "_log_softmax", 1},
    {"aten::_softmax_backward_data.default", "_softmax_backward_data", 0},
    {"aten::_log_softmax_backward_data.default", "_log_softmax_backward_data", 0},
    {"aten::native_layer_norm.default", "native_layer_norm", 0},
    {"aten::embedding.default", "embedding", 0},
    {"aten::gather.default", "gather", 1},
    {"aten::index_select.default", "index_select", 1},
};

const char *af_bridge_fast_binding(int i, const char **binding, int *out) {
    if (i < 0 || (size_t)i >= sizeof fast_bindings / sizeof fast_bindings[0]) return NULL;
    if (binding) *binding = fast_bindings[i].binding;
    if (out) *out = fast_bindings[i].out;
    return fast_bindings[i].op;
}

/* The torch.<name> binding standing for `qualified` (see fast_bindings), or NULL; *out whether it
 * also stands for the out= variant. */
static PyObject *fast_binding(const char *qualified, int *out) {
    for (size_t i = 0; i < sizeof fast_bindings / sizeof fast_bindings[0]; i++) {
        if (strcmp(qualified, fast_bindings[i].op) != 0) continue;
        *out = fast_bindings[i].out;
        if (!py.variable_functions) { /* torch._C._VariableFunctions, looked up once */
            PyObject *c = PyObject_GetAttrString(py.torch, "_C");
            py.variable_functions = c ? PyObject_GetAttrString(c, "_VariableFunctions") : NULL;
            Py_XDECREF(c);
        }
        PyObject *fn = py.variable_functions ? PyObject_GetAttrString(py.variable_functions, fast_bindings[i].binding) : NULL;
        if (!fn || !PyCallable_Check(fn)) {
            Py_XDECREF(fn);
            PyErr_Clear();
            return NULL;
        }
        return fn;
    }
    return NULL;
}

/* torch.ops.<ns>.<name>.<overload>, or its C callable `_op` when it has one, or its fast binding
 * (fast_bindings); e->may_alias from its schema, e->out_fn and e->out_kw its out= overload where it
 * has one. */
static PyObject *resolve_op(const char *qualified, af_extern *e) {
    char ns[128], name[256], overload[128] = "default";
    const char *sep = strstr(qualified, "::");
    if (!sep || (size_t)(sep - qualified) >= sizeof ns) {
        PyErr_Format(PyExc_ValueError, "op name '%s' is not namespace::name[.overload]", qualified);
        return NULL;
    }
    memcpy(ns, qualified, (size_t)(sep - qualified));
    ns[sep - qualified] = '\0';
    const char *rest = sep + 2, *dot = strchr(rest, '.');
    size_t name_len = dot ? (size_t)(dot - rest) : strlen(rest);
    if (name_len == 0 || name_len >= sizeof name || (dot && strlen(dot + 1) >= sizeof overload)) {
        PyErr_Format(PyExc_ValueError, "op name '%s' is malformed", qualified);
        return NULL;
    }
    memcpy(name, rest, name_len);
    name[name_len] = '\0';
    if (dot) strcpy(overload, dot + 1);
    PyObject *nsobj = PyObject_GetAttrString(py.ops, ns);
    PyObject *packet = nsobj ? PyObject_GetAttrString(nsobj, name) : NULL;
    PyObject *op = packet ? PyObject_GetAttrString(packet, overload) : NULL;
    Py_XDECREF(nsobj);
    if (!op) {
        Py_XDECREF(packet);
        return NULL;
    }
    e->may_alias = schema_may_alias(op);
    if (!e->may_alias) e->out_fn = resolve_out_variant(packet, op, &e->out_kw);
    Py_XDECREF(packet);
    int fast_out = 0;
    PyObject *fast = e->may_alias ? NULL : fast_binding(qualified, &fast_out);
    if (fast) {
        if (fast_out && e->out_fn && PyUnicode_CompareWithASCIIString(e->out_kw, "out") == 0) {
            Py_INCREF(fast);
            Py_SETREF(e->out_fn, fast);
        }
        Py_DECREF(op);
        return fast;
    }
    PyObject *c_op = PyObject_GetAttrString(op, "_op");
    if (c_op && PyCallable_Check(c_op)) {
        Py_DECREF(op);
        return c_op;
    }
    Py_XDECREF(c_op);
    PyErr_Clear();
    return op;
}

void af_extern_free(af_extern *e) {
    if (!e) return;
    Py_XDECREF(e->fn);
    Py_XDECREF(e->out_fn);
    Py_XDECREF(e->out_kw);
    Py_XDECREF(e->kwargs_into);
    if (e->pos_const)
        for (int32_t i = 0; i < e->n_pos; i++) Py_XDECREF(e->pos_const[i]);
    PyMem_Free(e->pos_const);
    Py_XDECREF(e->args_const);
    Py_XDECREF(e->kwargs_const);
    PyMem_Free(e);
}

int af_extern_new(const af_graph *g, int32_t node_index, af_extern **out) {
    const af_node *n = af_graph_node(g, node_index);
    if (!n || !out) return af_error_set(AF_ERR_INVALID, "af_extern_new: no node %d", (int)node_index);
    int st = af_bridge_init();
    if (st) return st;
    af_extern *e = PyMem_Calloc(1, sizeof *e);
    if (!e) return af_error_set(AF_ERR_NOMEM, "out of memory resolving %s", n->op);
    e->graph = g;
    e->node_index = node_index;
    e->fn = resolve_op(n->op, e);
    if (!e->fn) {
        st = bridge_fail(n->op);
        goto error;
    }
    while (e->n_pos < n->n_args && !n->args[e->n_pos].name) e->n_pos++;
    e->pos_const = PyMem_Calloc((size_t)e->n_pos + 1, sizeof(PyObject *));
    if (!e->pos_const) {
        st = af_error_set(AF_ERR_NOMEM, "out of memory resolving %s", n->op);
        goto error;
    }
    int all_const = 1;
    for (int32_t i = 0; i < e->n_pos; i++) {
        if (arg_has_value(&n->args[i])) {
            all_const = 0;
            continue;
        }
        if (!(e->pos_const[i] = arg_to_py(&n->args[i], NULL))) {
            st = bridge_fail(n->op);
            goto error;
        }
    }
    if (all_const) {
        if (!(e->args_const = PyTuple_New(e->n_pos))) {
            st = bridge_fail(n->op);
            goto error;
        }
        for (int32_t i = 0; i < e->n_pos; i++) {
            Py_INCREF(e->pos_const[i]);
            PyTuple_SET_ITEM(e->args_const, i, e->pos_const[i]);
        }
    }
    for (int32_t i = e->n_pos; i < n->n_args; i++) e->kw_dynamic |= arg_has_value(&n->args[i]);
    if (!e->kw_dynamic && e->n_pos < n->n_args) {
        if (!(e->kwargs_const = PyDict_New())) {
            st = bridge_fail(n->op);
            goto error;
        }
        for (int32_t i = e->n_pos; i < n->n_args; i++) {
            PyObject *v = arg_to_py(&n->args[i], NULL);
            if (!v || PyDict_SetItemString(e->kwargs_const, n->args[i].name, v) < 0) {
                Py_XDECREF(v);
                st = bridge_fail(n->op);
                goto error;
            }
            Py_DECREF(v);
        }
    }
    *out = e;
    return AF_OK;
error:
    af_extern_free(e);
    return st;
}

/* Adds a note naming the step to the pending exception, and returns the runtime status. */
static int extern_fail(const af_node *n, int32_t node_index) {
    int st = af_error_set(AF_ERR_RUNTIME, "aotfuse step %d (%s) failed", (int)node_index, n->op);
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    if (!type) {
        PyErr_SetString(PyExc_RuntimeError, af_error_message());
        return st;
    }
    PyErr_NormalizeException(&type, &value, &tb);
    if (value) {
        PyObject *r = PyObject_CallMethod(value, "add_note", "s", af_error_message());
        if (!r) PyErr_Clear();
        Py_XDECREF(r);
    }
    PyErr_Restore(type, value, tb);
    return st;
}

int af_extern_may_alias(const af_extern *e) { return !e || e->may_alias; }

int af_obj_sole_ref(const af_obj *o) { return o && Py_REFCNT((PyObject *)o) == 1; }

/* The integer a call returned, or -1 (the error cleared). */
static long long call_count(PyObject *r) {
    long long n = r ? PyLong_AsLongLong(r) : -1;
    Py_XDECREF(r);
    if (PyErr_Occurred()) PyErr_Clear(), n = -1;
    return n;
}

int af_obj_sole_owner(const af_obj *o) {
    PyObject *t = (PyObject *)o;
    if (!o || Py_REFCNT(t) != 1 || !py.torch) return 0;
    if (call_count(PyObject_CallMethod(t, "_use_count", NULL)) != 1) return 0; /* the TensorImpl: ours alone */
    if (!py.storage_use_count) {
        PyObject *c = PyObject_GetAttrString(py.torch, "_C");
        py.storage_use_count = c ? PyObject_GetAttrString(c, "_storage_Use_Count") : NULL;
        Py_XDECREF(c);
        if (!py.storage_use_count) {
            PyErr_Clear();
            return 0;
        }
    }
    static Py_ssize_t fresh_refs = -1; /* a storage object nobody keeps: ours, and torch's own if it keeps one */
    if (fresh_refs < 0) {
        PyObject *e = PyObject_CallMethod(py.torch, "empty", "i", 1);
        PyObject *es = e ? PyObject_CallMethod(e, "untyped_storage", NULL) : NULL;
        if (es) fresh_refs = Py_REFCNT(es);
        Py_XDECREF(es);
        Py_XDECREF(e);
        if (fresh_refs < 0) {
            PyErr_Clear();
            return 0;
        }
    }
    PyObject *storage = PyObject_CallMethod(t, "untyped_storage", NULL);
    /* a storage object someone keeps (a saved-tensor hook packing t.untyped_storage()) is handed
     * back as it is: then it has their reference too */
    int ok = storage && Py_REFCNT(storage) <= fresh_refs;
    /* memory torch does not own (from_numpy, from_blob, DLPack) may be seen elsewhere: such storage
     * is not resizable */
    PyObject *resizable = ok ? PyObject_CallMethod(storage, "resizable", NULL) : NULL;
    ok = ok && resizable == Py_True;
    PyObject *cdata = ok ? PyObject_GetAttrString(storage, "_cdata") : NULL;
    /* the storage: our TensorImpl's reference and the temporary storage object's */
    long long n = cdata ? call_count(PyObject_CallFunctionObjArgs(py.storage_use_count, cdata, NULL)) : -1;
    Py_XDECREF(cdata);
    Py_XDECREF(resizable);
    Py_XDECREF(storage);
    if (PyErr_Occurred()) PyErr_Clear();
    return ok && n == 2;
}

/* The call's positional and keyword arguments (new references; kwargs may be NULL). */
static int extern_args(af_extern *e, af_obj *const *values, PyObject **args_out, PyObject **kwargs_out) {
    const af_node *n = af_graph_node(e->graph, e->node_index);
    PyObject *args = NULL, *kwargs = NULL;
    if (e->args_const) {
        args = e->args_const;
        Py_INCREF(args);
    } else {
        if (!(args = PyTuple_New(e->n_pos))) return -1;
        for (int32_t i = 0; i < e->n_pos; i++) {
            PyObject *o = e->pos_const[i];
            if (o) Py_INCREF(o);
            else if (!(o = arg_to_py(&n->args[i], values))) goto error;
            PyTuple_SET_ITEM(args, i, o);
        }
    }
    if (e->kw_dynamic) {
        if (!(kwargs = PyDict_New())) goto error;
        for (int32_t i = e->n_pos; i < n->n_args; i++) {
            PyObject *v = arg_to_py(&n->args[i], values);
            if (!v || PyDict_SetItemString(kwargs, n->args[i].name, v) < 0) {
                Py_XDECREF(v);
                goto error;
            }
            Py_DECREF(v);
        }
    } else {
        kwargs = e->kwargs_const;
        Py_XINCREF(kwargs);
    }
    *args_out = args;
    *kwargs_out = kwargs;
    return 0;
error:
    Py_XDECREF(args);
    Py_XDECREF(kwargs);
    return -1;
}

int af_extern_can_write_into(const af_extern *e) { return e && e->out_fn != NULL; }

int af_extern_call_into(af_extern *e, af_obj *const *values, af_obj *into, af_obj **out) {
    const af_node *n = af_graph_node(e->graph, e->node_index);
    if (!e->out_fn || n->n_outputs != 1) return af_error_set(AF_ERR_INVALID, "%s has no out= overload", n->op);
    PyObject *args = NULL, *kwargs = NULL, *kw = NULL, *res = NULL;
    if (extern_args(e, values, &args, &kwargs) < 0) return extern_fail(n, e->node_index);
    if (e->kw_dynamic) { /* a dict of this call's own */
        kw = kwargs;
        kwargs = NULL;
    } else { /* built once: the constant kwargs, and the written tensor set for the call only */
        if (!e->kwargs_into) e->kwargs_into = e->kwargs_const ? PyDict_Copy(e->kwargs_const) : PyDict_New();
        kw = e->kwargs_into;
        Py_XINCREF(kw);
    }
    if (kw && PyDict_SetItem(kw, e->out_kw, (PyObject *)into) == 0) {
        res = PyObject_Call(e->out_fn, args, kw);
        if (!res) PyErr_Clear(); /* refused: see below */
        if (PyDict_DelItem(kw, e->out_kw) < 0) PyErr_Clear(); /* the dict does not keep the tensor */
    }
    Py_XDECREF(args);
    Py_XDECREF(kwargs);
    Py_XDECREF(kw);
    if (!res || res != (PyObject *)into) { /* refused (autograd, say): the plain call will say why, if it fails too */
        Py_XDECREF(res);
        PyErr_Clear();
        return AF_BRIDGE_NOT_INTO;
    }
    *out = (af_obj *)res;
    return AF_OK;
}

int af_extern_call(af_extern *e, af_obj *const *values, af_obj **outs) {
    const af_node *n = af_graph_node(e->graph, e->node_index);
    PyObject *args = NULL, *kwargs = NULL, *res = NULL;
    if (extern_args(e, values, &args, &kwargs) < 0) return extern_fail(n, e->node_index);
    res = PyObject_Call(e->fn, args, kwargs);
    if (!res) goto error;
    Py_CLEAR(args);
    Py_CLEAR(kwargs);

    /* one result per output; tuples and lists are unpacked */
    PyObject *single[1] = {res};
    PyObject *const *items = single;
    Py_ssize_t count = 1;
    if (PyTuple_Check(res) || PyList_Check(res)) {
        count = PySequence_Fast_GET_SIZE(res);
        items = PySequence_Fast_ITEMS(res);
    }
    if (count != n->n_outputs) {
        PyErr_Format(PyExc_RuntimeError, "aotfuse runtime: %s returned %zd results, the graph expects %d", n->op,
                     count, (int)n->n_outputs);
        goto error;
    }
    for (int32_t o = 0; o < n->n_outputs; o++) {
        const af_value *v = af_graph_value(e->graph, n->first_output + o);
        if (v->meta.type == AF_VALUE_TENSOR && !PyObject_TypeCheck(items[o], py.tensor_type)) {
            PyErr_Format(PyExc_RuntimeError, "aotfuse runtime: %s output %d is a %s, the graph expects a tensor",
                         n->op, (int)o, Py_TYPE(items[o])->tp_name);
            goto error;
        }
    }
    for (int32_t o = 0; o < n->n_outputs; o++) {
        Py_INCREF(items[o]);
        outs[o] = (af_obj *)items[o];
    }
    Py_DECREF(res);
    return AF_OK;
error:
    Py_XDECREF(args);
    Py_XDECREF(kwargs);
    Py_XDECREF(res);
    return extern_fail(n, e->node_index);
}

/* ---- checking tensors through the shim ---- */

/* The data pointer check_one read for a kernel operand (name == NULL). */
static void *kernel_ptr;

/* torch._C._aoti hands handles back as nameless capsules (older builds: ints). */
static aten_handle handle_of(PyObject *o) {
    if (PyCapsule_CheckExact(o)) return PyCapsule_GetPointer(o, PyCapsule_GetName(o));
    return PyLong_AsVoidPtr(o);
}

static int meta_is_empty(const af_tensor_meta *m) {
    for (int32_t d = 0; d < m->ndim; d++)
        if (m->sizes[d] == 0) return 1;
    return 0;
}

static int check_one(aten_handle h, const af_tensor_meta *m, const char *name) {
    int64_t dim = 0, *sizes = NULL, *strides = NULL, offset = 0;
    int32_t dtype = 0, dev = 0, dev_index = 0;
    if (!name) { /* a kernel operand: compare quietly, read the data pointer */
        void *ptr = NULL;
        if (shim.aoti_torch_get_dim(h, &dim) || shim.aoti_torch_get_sizes(h, &sizes) ||
            shim.aoti_torch_get_strides(h, &strides) || shim.aoti_torch_get_dtype(h, &dtype) ||
            shim.aoti_torch_get_device_type(h, &dev) || shim.aoti_torch_get_data_ptr(h, &ptr))
            return af_error_set(AF_ERR_BRIDGE, "torch's shim could not read a kernel operand");
        if (dtype != torch_dtype_code[m->dtype] || dev != torch_device_code[m->device.type] || dim != m->ndim)
            return AF_BRIDGE_LAYOUT_MISMATCH;
        int empty = meta_is_empty(m); /* no elements: any strides read the same (none) */
        for (int32_t d = 0; d < m->ndim; d++)
            if (sizes[d] != m->sizes[d] || (!empty && sizes[d] > 1 && strides[d] != m->strides[d]))
                return AF_BRIDGE_LAYOUT_MISMATCH;
        kernel_ptr = ptr;
        return AF_OK;
    }
    if (shim.aoti_torch_get_dim(h, &dim) || shim.aoti_torch_get_sizes(h, &sizes) ||
        shim.aoti_torch_get_strides(h, &strides) || shim.aoti_torch_get_dtype(h, &dtype) ||
        shim.aoti_torch_get_device_type(h, &dev) || shim.aoti_torch_get_device_index(h, &dev_index) ||
        shim.aoti_torch_get_storage_offset(h, &offset))
        return af_error_set(AF_ERR_BRIDGE, "input %s: torch's shim could not read its metadata", name);
    if (dtype != torch_dtype_code[m->dtype])
        return af_error_set(AF_ERR_INVALID, "input %s: dtype code %d, the program was compiled for %s", name,
                            (int)dtype, af_dtype_name(m->dtype));
    /* A 0-dim tensor may sit on the CPU beside CUDA tensors (ATen takes it as a scalar), and some
     * ops return one where their fake-tensor meta says the GPU (the philox seed and offset of
     * fp32 memory-efficient attention); such an input never reaches a kernel unchecked (kernel
     * operands are checked again, and fall back). */
    int scalar_elsewhere = dim == 0 && m->ndim == 0 && (dev == torch_device_code[AF_DEVICE_CPU] ||
                                                        m->device.type == AF_DEVICE_CPU);
    if (!scalar_elsewhere &&
        (dev != torch_device_code[m->device.type] || (m->device.index >= 0 && dev_index != m->device.index)))
        return af_error_set(AF_ERR_INVALID, "input %s: on another device than the program's %s:%d", name,
                            af_device_type_name(m->device.type), (int)m->device.index);
    if (dim != m->ndim)
        return af_error_set(AF_ERR_INVALID, "input %s: rank %" PRId64 ", the program was compiled for rank %d", name,
                            dim, (int)m->ndim);
    /* a tensor without elements (a batch of 0) has no layout to keep: torch calls any strides of it
     * contiguous (the expanded gradient of a sum, strides 0, stays as it is) */
    int empty = meta_is_empty(m);
    for (int32_t d = 0; d < m->ndim; d++) {
        if (sizes[d] != m->sizes[d])
            return af_error_set(AF_ERR_INVALID, "input %s: size %" PRId64 " in dim %d, the program was compiled for %" PRId64,
                                name, sizes[d], (int)d, m->sizes[d]);
        if (!empty && sizes[d] > 1 && strides[d] != m->strides[d])
            return af_error_set(AF_ERR_INVALID, "input %s: stride %" PRId64 " in dim %d, the program was compiled for %" PRId64,
                                name, strides[d], (int)d, m->strides[d]);
    }
    return AF_OK;
}

/* Runs check_one over every tensor input: names != NULL checks program inputs (errors name
 * them); names == NULL reads kernel operands into ptrs (a mismatch is reported softly). */
static int visit_tensors(af_obj *const *objs, const af_tensor_meta *const *metas, const char *const *names,
                         int32_t n, void **ptrs) {
    int st = af_bridge_init();
    if (st) return st;
    for (int32_t i = 0; i < n; i++) {
        int is_tensor = PyObject_TypeCheck((PyObject *)objs[i], py.tensor_type);
        if (metas[i]->type == AF_VALUE_TENSOR && !is_tensor) {
            if (!names) return AF_BRIDGE_LAYOUT_MISMATCH;
            return af_error_set(AF_ERR_INVALID, "input %s: a %s where the program takes a tensor", names[i],
                                Py_TYPE((PyObject *)objs[i])->tp_name);
        }
    }
#define VISIT(h, i)                                                   \
    do {                                                              \
        int r_ = check_one((h), metas[i], names ? names[i] : NULL);   \
        if (!r_ && ptrs) ptrs[i] = kernel_ptr;                        \
        if (!st) st = r_;                                             \
    } while (0)
    if (shim.torch_tensor_from_pyobject) {
        for (int32_t i = 0; i < n && !st; i++) {
            if (metas[i]->type != AF_VALUE_TENSOR) continue;
            aten_handle h = NULL;
            if (shim.torch_tensor_from_pyobject((void *)objs[i], &h) || !h)
                return af_error_set(AF_ERR_BRIDGE, "torch_tensor_from_pyobject failed");
            VISIT(h, i);
            shim.aoti_torch_delete_tensor_object(h);
        }
        return st;
    }
    /* one Python call turns every tensor into an owning shim handle */
    PyObject *list = PyList_New(0), *handles = NULL;
    if (!list) return bridge_fail("reading tensors");
    for (int32_t i = 0; i < n; i++)
        if (metas[i]->type == AF_VALUE_TENSOR && PyList_Append(list, (PyObject *)objs[i]) < 0) {
            Py_DECREF(list);
            return bridge_fail("reading tensors");
        }
    handles = PyObject_CallOneArg(py.handles_from_tensors, list);
    Py_DECREF(list);
    if (!handles || !PyList_Check(handles)) {
        Py_XDECREF(handles);
        return bridge_fail("torch._C._aoti.unsafe_alloc_void_ptrs_from_tensors");
    }
    Py_ssize_t k = 0, nh = PyList_GET_SIZE(handles);
    for (int32_t i = 0; i < n; i++) {
        if (metas[i]->type != AF_VALUE_TENSOR) continue;
        aten_handle h = k < nh ? handle_of(PyList_GET_ITEM(handles, k)) : NULL;
        k++;
        if (!h) {
            PyErr_Clear();
            if (!st) st = af_error_set(AF_ERR_BRIDGE, "tensor %d: no shim handle", (int)i);
            continue;
        }
        if (!st) VISIT(h, i);
        shim.aoti_torch_delete_tensor_object(h); /* every handle is owned: delete all of them */
    }
#undef VISIT
    for (; k < nh; k++) {
        aten_handle h = handle_of(PyList_GET_ITEM(handles, k));
        if (h) shim.aoti_torch_delete_tensor_object(h);
    }
    PyErr_Clear();
    Py_DECREF(handles);
    return st;
}

int af_bridge_check_tensors(af_obj *const *objs, const af_tensor_meta *const *metas, const char *const *names,
                            int32_t n) {
    return visit_tensors(objs, metas, names, n, NULL);
}

int af_bridge_tensor_data(af_obj *const *objs, const af_tensor_meta *const *metas, int32_t n, void **ptrs) {
    return visit_tensors(objs, metas, NULL, n, ptrs);
}

int af_bridge_data_ptrs(af_obj *const *objs, int32_t n, void **ptrs) {
    static PyObject *name;
    if (!name && !(name = PyUnicode_InternFromString("data_ptr"))) return bridge_fail("reading data pointers");
    for (int32_t i = 0; i < n; i++) {
        PyObject *r = PyObject_CallMethodNoArgs((PyObject *)objs[i], name);
        ptrs[i] = r ? PyLong_AsVoidPtr(r) : NULL;
        Py_XDECREF(r);
        if (!r || (!ptrs[i] && PyErr_Occurred())) return bridge_fail("Tensor.data_ptr()");
    }
    return AF_OK;
}

int af_bridge_storage_offset(af_obj *t, int64_t *out) {
    static PyObject *name;
    if (!t || !out) return af_error_set(AF_ERR_INVALID, "af_bridge_storage_offset: NULL argument");
    if (!name && !(name = PyUnicode_InternFromString("storage_offset"))) return bridge_fail("reading a storage offset");
    PyObject *r = PyObject_CallMethodNoArgs((PyObject *)t, name);
    *out = r ? PyLong_AsLongLong(r) : -1;
    Py_XDECREF(r);
    if (!r || (*out == -1 && PyErr_Occurred())) return bridge_fail("Tensor.storage_offset()");
    return AF_OK;
}

/* (args, kwargs, (sizes, strides, dtype)) for torch.empty_strided(sizes, strides, dtype=...,
 * device=...) and for the fast allocators, or NULL with a Python error set. */
static PyObject *empty_call(const af_tensor_meta *m) {
    PyObject *sizes = PyTuple_New(m->ndim), *strides = PyTuple_New(m->ndim), *args = NULL, *kw = NULL, *call = NULL;
    if (!sizes || !strides) goto done;
    for (int32_t d = 0; d < m->ndim; d++) {
        PyObject *a = PyLong_FromLongLong(m->sizes[d]), *b = PyLong_FromLongLong(m->strides[d]);
        if (!a || !b) {
            Py_XDECREF(a);
            Py_XDECREF(b);
            goto done;
        }
        PyTuple_SET_ITEM(sizes, d, a);
        PyTuple_SET_ITEM(strides, d, b);
    }
    args = PyTuple_Pack(2, sizes, strides);
    kw = Py_BuildValue("{s:O}", "dtype", py.dtypes[m->dtype]);
    if (!args || !kw) goto done;
    if (m->device.type != AF_DEVICE_CPU) {
        PyObject *dev = m->device.index >= 0
                            ? PyObject_CallFunction(py.device_ctor, "si", af_device_type_name(m->device.type), (int)m->device.index)
                            : PyObject_CallFunction(py.device_ctor, "s", af_device_type_name(m->device.type));
        if (!dev || PyDict_SetItemString(kw, "device", dev) < 0) {
            Py_XDECREF(dev);
            goto done;
        }
        Py_DECREF(dev);
    }
    PyObject *fast = PyTuple_Pack(3, sizes, strides, py.dtypes[m->dtype]);
    if (fast) call = PyTuple_Pack(3, args, kw, fast);
    Py_XDECREF(fast);
done:
    Py_XDECREF(sizes);
    Py_XDECREF(strides);
    Py_XDECREF(args);
    Py_XDECREF(kw);
    return call;
}

int af_bridge_empty_cached(const af_tensor_meta *m, af_obj **args, af_obj **out) {
    int st = af_bridge_init();
    if (st) return st;
    if (!*args && !(*args = (af_obj *)empty_call(m))) return af_error_set(AF_ERR_RUNTIME, "allocating a kernel output failed");
    PyObject *call = (PyObject *)*args, *t = NULL;
    if (!py.empty_looked_up) {
        py.empty_looked_up = 1;
        PyObject *c = PyObject_GetAttrString(py.torch, "_C");
        PyObject *d = c ? PyObject_GetAttrString(c, "_dynamo") : NULL;
        PyObject *guards = d ? PyObject_GetAttrString(d, "guards") : NULL;
        py.empty_cpu = guards ? PyObject_GetAttrString(guards, "_empty_strided_cpu") : NULL;
        PyErr_Clear();
        py.empty_cuda = guards ? PyObject_GetAttrString(guards, "_empty_strided_cuda") : NULL;
        PyErr_Clear();
        py.cuda_get_device = c ? PyObject_GetAttrString(c, "_cuda_getDevice") : NULL;
        PyErr_Clear();
        Py_XDECREF(guards);
        Py_XDECREF(d);
        Py_XDECREF(c);
    }
    PyObject *fast = NULL;
    if (m->device.type == AF_DEVICE_CPU) {
        fast = py.empty_cpu;
    } else if (m->device.type == AF_DEVICE_CUDA && py.empty_cuda && py.cuda_get_device) {
        PyObject *cur = PyObject_CallNoArgs(py.cuda_get_device);
        long idx = cur ? PyLong_AsLong(cur) : -2;
        Py_XDECREF(cur);
        PyErr_Clear();
        if (idx == (m->device.index < 0 ? 0 : m->device.index)) fast = py.empty_cuda;
    }
    if (fast) {
        t = PyObject_Call(fast, PyTuple_GET_ITEM(call, 2), NULL);
        if (!t) PyErr_Clear(); /* torch.empty_strided below tries again, and says why it fails */
    }
    if (!t) t = PyObject_Call(py.empty_strided, PyTuple_GET_ITEM(call, 0), PyTuple_GET_ITEM(call, 1));
    if (!t) /* the Python error (torch.OutOfMemoryError, say) stays pending for the caller to raise */
        return af_error_set(AF_ERR_RUNTIME, "allocating a kernel output failed");
    *out = (af_obj *)t;
    return AF_OK;
}

int af_bridge_empty(const af_tensor_meta *m, af_obj **out) {
    af_obj *args = NULL;
    int st = af_bridge_empty_cached(m, &args, out);
    af_obj_release(args);
    return st;
}

int af_bridge_copy_into(af_obj *dst, af_obj *src) {
    int st = af_bridge_init();
    if (st) return st;
    PyObject *r = PyObject_CallMethod((PyObject *)dst, "copy_", "O", (PyObject *)src);
    if (!r) return bridge_fail("copying a tensor into the layout the graph gives it (Tensor.copy_)");
    Py_DECREF(r);
    return AF_OK;
}

int af_bridge_cuda_stream(int32_t device, void **stream) {
    int st = af_bridge_init();
    if (st) return st;
    PyObject *r = NULL;
    if (!py.raw_stream) {
        PyObject *c = PyObject_GetAttrString(py.torch, "_C");
        py.raw_stream = c ? PyObject_GetAttrString(c, "_cuda_getCurrentRawStream") : NULL;
        Py_XDECREF(c);
        PyErr_Clear();
    }
    if (py.raw_stream) {
        r = PyObject_CallFunction(py.raw_stream, "i", (int)device);
    } else { /* torch.cuda.current_stream(device).cuda_stream */
        PyObject *cuda = PyObject_GetAttrString(py.torch, "cuda");
        PyObject *s = cuda ? PyObject_CallMethod(cuda, "current_stream", "i", (int)device) : NULL;
        r = s ? PyObject_GetAttrString(s, "cuda_stream") : NULL;
        Py_XDECREF(s);
        Py_XDECREF(cuda);
    }
    if (!r) return bridge_fail("reading torch's current CUDA stream failed");
    void *p = PyLong_AsVoidPtr(r);
    Py_DECREF(r);
    if (PyErr_Occurred()) return bridge_fail("torch's current CUDA stream is not an address");
    *stream = p;
    return AF_OK;
}

int af_bridge_can_reinterpret(void) {
    if (af_bridge_init()) {
        af_error_clear();
        return 0;
    }
    if (!py.reinterpret_looked_up) { /* what inductor's generated code uses to make views */
        py.reinterpret_looked_up = 1;
        PyObject *c = PyObject_GetAttrString(py.torch, "_C");
        PyObject *d = c ? PyObject_GetAttrString(c, "_dynamo") : NULL;
        PyObject *guards = d ? PyObject_GetAttrString(d, "guards") : NULL;
        py.reinterpret = guards ? PyObject_GetAttrString(guards, "_reinterpret_tensor") : NULL;
        Py_XDECREF(guards);
        Py_XDECREF(d);
        Py_XDECREF(c);
        PyErr_Clear();
    }
    return py.reinterpret != NULL;
}

/* (sizes, strides, offset) of m as Python objects, for _reinterpret_tensor; NULL with an error set. */
static PyObject *reinterpret_args(const af_tensor_meta *m, int64_t offset_delta) {
    PyObject *sizes = PyTuple_New(m->ndim), *strides = PyTuple_New(m->ndim), *offset = PyLong_FromLongLong(offset_delta);
    for (int32_t d = 0; sizes && strides && d < m->ndim; d++) {
        PyObject *a = PyLong_FromLongLong(m->sizes[d]), *b = PyLong_FromLongLong(m->strides[d]);
        if (!a || !b) {
            Py_XDECREF(a);
            Py_XDECREF(b);
            Py_CLEAR(sizes);
            break;
        }
        PyTuple_SET_ITEM(sizes, d, a);
        PyTuple_SET_ITEM(strides, d, b);
    }
    PyObject *args = sizes && strides && offset ? PyTuple_Pack(3, sizes, strides, offset) : NULL;
    Py_XDECREF(sizes);
    Py_XDECREF(strides);
    Py_XDECREF(offset);
    return args;
}

int af_bridge_reinterpret_cached(af_obj *base, const af_tensor_meta *m, int64_t offset_delta, af_obj **args, af_obj **out) {
    if (!af_bridge_can_reinterpret()) return af_error_set(AF_ERR_BRIDGE, "torch has no _reinterpret_tensor");
    if (*args && PyLong_AsLongLong(PyTuple_GET_ITEM((PyObject *)*args, 2)) != offset_delta) { /* another base now */
        af_obj_release(*args);
        *args = NULL;
    }
    if (!*args && !(*args = (af_obj *)reinterpret_args(m, offset_delta)))
        return bridge_fail("making a view (torch._C._dynamo.guards._reinterpret_tensor)");
    PyObject *a = (PyObject *)*args;
    PyObject *argv[4] = {(PyObject *)base, PyTuple_GET_ITEM(a, 0), PyTuple_GET_ITEM(a, 1), PyTuple_GET_ITEM(a, 2)};
    PyObject *r = PyObject_Vectorcall(py.reinterpret, argv, 4, NULL);
    if (!r) return bridge_fail("making a view (torch._C._dynamo.guards._reinterpret_tensor)");
    *out = (af_obj *)r;
    return AF_OK;
}

int af_bridge_reinterpret(af_obj *base, const af_tensor_meta *m, int64_t offset_delta, af_obj **out) {
    af_obj *args = NULL;
    int st = af_bridge_reinterpret_cached(base, m, offset_delta, &args, out);
    af_obj_release(args);
    return st;
}

int af_bridge_same_view(af_obj *const *objs, const af_tensor_meta *const *metas) {
    void *ptrs[2] = {NULL, NULL};
    int st = af_bridge_tensor_data(objs, metas, 2, ptrs);
    if (st) return st;
    int64_t want = (metas[1]->storage_offset - metas[0]->storage_offset) * af_dtype_itemsize(metas[1]->dtype);
    return (char *)ptrs[1] - (char *)ptrs[0] == want ? AF_OK : AF_BRIDGE_LAYOUT_MISMATCH;
}

int af_bridge_num_threads(int *n) {
    int st = af_bridge_init();
    if (st) return st;
    if (!py.get_num_threads) py.get_num_threads = PyObject_GetAttrString(py.torch, "get_num_threads");
    PyObject *r = py.get_num_threads ? PyObject_CallNoArgs(py.get_num_threads) : NULL;
    long v = r ? PyLong_AsLong(r) : -1;
    Py_XDECREF(r);
    if (v < 1 || PyErr_Occurred()) return bridge_fail("torch.get_num_threads() failed");
    *n = (int)(v > 4096 ? 4096 : v);
    return AF_OK;
}

void af_bridge_run_kernel(af_body_fn fn, char *const *ptrs, const uint64_t *streams, const int64_t *sizes, int num_threads) {
    Py_BEGIN_ALLOW_THREADS
    fn(ptrs, streams, sizes, num_threads);
    Py_END_ALLOW_THREADS
}
