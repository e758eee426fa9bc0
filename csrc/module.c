/* aotfuse._C: the Python bindings. The only file that turns statuses into exceptions.
 *
 *   Graph()                  build an IR graph: add_input, add_node, set_outputs, verify, str()
 *   Program(graph)           plan and resolve a graph (the graph is consumed); run(inputs)
 *   bridge_info()            {shim function name: found}
 *   op_kind(name)            the op table's kind of an op ("extern" if unknown)
 *   Error                    raised for every status the core reports
 *
 * Encodings from Python (made by aotfuse/lower.py):
 *   meta: ("tensor", dtype, device_type, device_index, sizes, strides, storage_offset) | ("other",)
 *   arg:  ("v", id) | ("none",) | ("bool", b) | ("int", i) | ("float", f) | ("str", s)
 *         | ("dtype", name) | ("device", type, index) | ("layout", name)
 *         | ("memory_format", name) | ("list", [arg, ...])
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdlib.h>
#include <string.h>

#include "aotfuse/bridge.h"
#include "aotfuse/codegen.h"
#include "aotfuse/fuse.h"
#include "aotfuse/jit.h"
#include "aotfuse/jit_cuda.h"
#include "aotfuse/ir.h"
#include "aotfuse/ops.h"
#include "aotfuse/partition.h"
#include "aotfuse/runtime.h"
#include "aotfuse/templates.h"

static PyObject *AotfuseError;

/* Raises for a failed status: an exception an extern left pending propagates as it is
 * (with a note naming the step); anything else becomes aotfuse._C.Error. */
static PyObject *raise_status(int st) {
    if (!PyErr_Occurred())
        PyErr_Format(AotfuseError, "%s: %s", af_status_name(st), af_error_message());
    return NULL;
}

/* ---- decoding ---- */

typedef struct {
    int64_t sizes[AF_MAX_DIMS], strides[AF_MAX_DIMS];
    af_tensor_meta meta;
} meta_buf;

static int decode_meta(PyObject *t, meta_buf *mb) {
    memset(mb, 0, sizeof *mb);
    const char *kind;
    if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) < 1 || !(kind = PyUnicode_AsUTF8(PyTuple_GET_ITEM(t, 0)))) {
        PyErr_SetString(PyExc_TypeError, "meta must be a tuple starting with 'tensor' or 'other'");
        return -1;
    }
    if (strcmp(kind, "other") == 0) {
        mb->meta.type = AF_VALUE_OTHER;
        return 0;
    }
    const char *dtype, *devtype;
    int devindex;
    PyObject *sizes, *strides;
    long long offset;
    if (strcmp(kind, "tensor") != 0 ||
        !PyArg_ParseTuple(t, "sssiOOL", &kind, &dtype, &devtype, &devindex, &sizes, &strides, &offset)) {
        if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "unknown meta kind '%s'", kind);
        return -1;
    }
    mb->meta.type = AF_VALUE_TENSOR;
    int st;
    if ((st = af_dtype_parse(dtype, &mb->meta.dtype)) || (st = af_device_type_parse(devtype, &mb->meta.device.type))) {
        raise_status(st);
        return -1;
    }
    mb->meta.device.index = devindex;
    mb->meta.storage_offset = offset;
    PyObject *fs = PySequence_Fast(sizes, "sizes must be a sequence"), *ft = NULL;
    if (!fs) return -1;
    ft = PySequence_Fast(strides, "strides must be a sequence");
    if (!ft) goto error;
    Py_ssize_t nd = PySequence_Fast_GET_SIZE(fs);
    if (nd > AF_MAX_DIMS || PySequence_Fast_GET_SIZE(ft) != nd) {
        PyErr_Format(PyExc_ValueError, "rank %zd: sizes and strides must agree and be at most %d long", nd, AF_MAX_DIMS);
        goto error;
    }
    for (Py_ssize_t d = 0; d < nd; d++) {
        mb->sizes[d] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(fs, d));
        mb->strides[d] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(ft, d));
        if (PyErr_Occurred()) goto error;
    }
    mb->meta.ndim = (int32_t)nd;
    mb->meta.sizes = mb->sizes;
    mb->meta.strides = mb->strides;
    Py_DECREF(fs);
    Py_DECREF(ft);
    return 0;
error:
    Py_XDECREF(fs);
    Py_XDECREF(ft);
    return -1;
}

static void free_arg(af_arg *a) {
    if (a->kind == AF_ARG_LIST) {
        for (int32_t i = 0; i < a->u.list.n; i++) free_arg(&a->u.list.items[i]);
        free(a->u.list.items);
    }
}

/* Decodes an encoded argument into *a (list items malloc'd; strings borrowed from t). */
static int decode_arg(PyObject *t, af_arg *a, int depth) {
    memset(a, 0, sizeof *a);
    const char *tag;
    if (depth > 8) {
        PyErr_SetString(PyExc_ValueError, "argument nested too deeply");
        return -1;
    }
    if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) < 1 || !(tag = PyUnicode_AsUTF8(PyTuple_GET_ITEM(t, 0)))) {
        PyErr_SetString(PyExc_TypeError, "an argument must be a tagged tuple such as ('int', 3)");
        return -1;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(t);
    PyObject *x = n > 1 ? PyTuple_GET_ITEM(t, 1) : NULL;
    if (strcmp(tag, "none") == 0) {
        a->kind = AF_ARG_NONE;
        return 0;
    }
    if (!x) goto bad;
    if (strcmp(tag, "v") == 0) {
        a->kind = AF_ARG_VALUE;
        long v = PyLong_AsLong(x);
        if (v == -1 && PyErr_Occurred()) return -1;
        if (v < 0 || v > INT32_MAX) goto bad;
        a->u.value = (int32_t)v;
    } else if (strcmp(tag, "bool") == 0) {
        a->kind = AF_ARG_BOOL;
        int b = PyObject_IsTrue(x);
        if (b < 0) return -1;
        a->u.i = b;
    } else if (strcmp(tag, "int") == 0) {
        a->kind = AF_ARG_INT;
        a->u.i = PyLong_AsLongLong(x);
        if (a->u.i == -1 && PyErr_Occurred()) return -1;
    } else if (strcmp(tag, "float") == 0) {
        a->kind = AF_ARG_FLOAT;
        a->u.f = PyFloat_AsDouble(x);
        if (a->u.f == -1.0 && PyErr_Occurred()) return -1;
    } else if (strcmp(tag, "complex") == 0) {
        a->kind = AF_ARG_COMPLEX;
        Py_complex c = PyComplex_AsCComplex(x);
        if (c.real == -1.0 && PyErr_Occurred()) return -1;
        a->u.c.re = c.real, a->u.c.im = c.imag;
    } else if (strcmp(tag, "str") == 0 || strcmp(tag, "layout") == 0 || strcmp(tag, "memory_format") == 0) {
        a->kind = tag[0] == 's' ? AF_ARG_STR : tag[0] == 'l' ? AF_ARG_LAYOUT : AF_ARG_MEMORY_FORMAT;
        if (!(a->u.s = PyUnicode_AsUTF8(x))) return -1;
    } else if (strcmp(tag, "dtype") == 0) {
        a->kind = AF_ARG_DTYPE;
        const char *name = PyUnicode_AsUTF8(x);
        if (!name) return -1;
        int st = af_dtype_parse(name, &a->u.dtype);
        if (st) {
            raise_status(st);
            return -1;
        }
    } else if (strcmp(tag, "device") == 0) {
        a->kind = AF_ARG_DEVICE;
        const char *name = PyUnicode_AsUTF8(x);
        if (!name || n < 3) goto bad;
        int st = af_device_type_parse(name, &a->u.device.type);
        if (st) {
            raise_status(st);
            return -1;
        }
        long idx = PyLong_AsLong(PyTuple_GET_ITEM(t, 2));
        if (idx == -1 && PyErr_Occurred()) return -1;
        a->u.device.index = (int32_t)idx;
    } else if (strcmp(tag, "list") == 0) {
        a->kind = AF_ARG_LIST;
        PyObject *f = PySequence_Fast(x, "a list argument needs a sequence");
        if (!f) return -1;
        Py_ssize_t k = PySequence_Fast_GET_SIZE(f);
        a->u.list.items = calloc((size_t)k + 1, sizeof(af_arg));
        if (!a->u.list.items) {
            Py_DECREF(f);
            PyErr_NoMemory();
            return -1;
        }
        for (Py_ssize_t i = 0; i < k; i++) {
            if (decode_arg(PySequence_Fast_GET_ITEM(f, i), &a->u.list.items[i], depth + 1) < 0) {
                a->u.list.n = (int32_t)i;
                free_arg(a);
                Py_DECREF(f);
                return -1;
            }
        }
        a->u.list.n = (int32_t)k;
        Py_DECREF(f);
    } else {
        goto bad;
    }
    return 0;
bad:
    PyErr_Format(PyExc_ValueError, "malformed argument with tag '%s'", tag);
    return -1;
}

/* ---- Graph ---- */

typedef struct {
    PyObject_HEAD
    af_graph *g; /* NULL once a Program took it */
} GraphObject;

static int graph_alive(GraphObject *self) {
    if (self->g) return 1;
    PyErr_SetString(AotfuseError, "this Graph was consumed by a Program");
    return 0;
}

static PyObject *Graph_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    (void)args;
    (void)kwds;
    GraphObject *self = (GraphObject *)type->tp_alloc(type, 0);
    if (!self) return NULL;
    int st = af_graph_new(&self->g);
    if (st) {
        Py_DECREF(self);
        return raise_status(st);
    }
    return (PyObject *)self;
}

static void Graph_dealloc(GraphObject *self) {
    af_graph_free(self->g);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Graph_add_input(GraphObject *self, PyObject *args) {
    const char *name;
    PyObject *meta;
    meta_buf mb;
    if (!graph_alive(self) || !PyArg_ParseTuple(args, "zO", &name, &meta) || decode_meta(meta, &mb) < 0) return NULL;
    int32_t id;
    int st = af_graph_add_input(self->g, name, &mb.meta, &id);
    return st ? raise_status(st) : PyLong_FromLong(id);
}

static PyObject *Graph_add_node(GraphObject *self, PyObject *args) {
    const char *op;
    PyObject *pos, *kw, *metas;
    if (!graph_alive(self) || !PyArg_ParseTuple(args, "sOOO", &op, &pos, &kw, &metas)) return NULL;
    PyObject *fp = PySequence_Fast(pos, "args must be a sequence");
    PyObject *fk = fp ? PySequence_Fast(kw, "kwargs must be a sequence of (name, arg)") : NULL;
    PyObject *fm = fk ? PySequence_Fast(metas, "metas must be a sequence") : NULL;
    af_arg *a = NULL;
    meta_buf *mbs = NULL;
    PyObject *result = NULL;
    Py_ssize_t np = 0, nk = 0, nm = 0, decoded = 0;
    if (!fm) goto done;
    np = PySequence_Fast_GET_SIZE(fp);
    nk = PySequence_Fast_GET_SIZE(fk);
    nm = PySequence_Fast_GET_SIZE(fm);
    a = calloc((size_t)(np + nk) + 1, sizeof *a);
    mbs = calloc((size_t)nm + 1, sizeof *mbs);
    af_tensor_meta *ms = calloc((size_t)nm + 1, sizeof *ms);
    if (!a || !mbs || !ms) {
        free(ms);
        PyErr_NoMemory();
        goto done;
    }
    for (; decoded < np; decoded++)
        if (decode_arg(PySequence_Fast_GET_ITEM(fp, decoded), &a[decoded], 0) < 0) goto done_ms;
    for (Py_ssize_t i = 0; i < nk; i++, decoded++) {
        PyObject *pair = PySequence_Fast_GET_ITEM(fk, i);
        const char *kname;
        PyObject *karg;
        if (!PyTuple_Check(pair) || !PyArg_ParseTuple(pair, "sO", &kname, &karg)) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "kwargs items must be (name, arg) tuples");
            goto done_ms;
        }
        if (decode_arg(karg, &a[decoded], 0) < 0) goto done_ms;
        a[decoded].name = kname;
    }
    for (Py_ssize_t i = 0; i < nm; i++) {
        if (decode_meta(PySequence_Fast_GET_ITEM(fm, i), &mbs[i]) < 0) goto done_ms;
        ms[i] = mbs[i].meta;
        ms[i].sizes = mbs[i].sizes;
        ms[i].strides = mbs[i].strides;
    }
    int32_t first;
    int st = af_graph_add_node(self->g, op, a, (int32_t)(np + nk), ms, (int32_t)nm, &first);
    if (st) {
        raise_status(st);
        goto done_ms;
    }
    result = PyList_New(nm);
    for (Py_ssize_t i = 0; result && i < nm; i++) {
        PyObject *id = PyLong_FromLong(first + (long)i);
        if (!id) Py_CLEAR(result);
        else PyList_SET_ITEM(result, i, id);
    }
done_ms:
    free(ms);
done:
    for (Py_ssize_t i = 0; a && i < decoded; i++) free_arg(&a[i]);
    free(a);
    free(mbs);
    Py_XDECREF(fp);
    Py_XDECREF(fk);
    Py_XDECREF(fm);
    return result;
}

static PyObject *Graph_set_outputs(GraphObject *self, PyObject *ids) {
    if (!graph_alive(self)) return NULL;
    PyObject *f = PySequence_Fast(ids, "outputs must be a sequence of value ids");
    if (!f) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(f);
    int32_t *buf = malloc(((size_t)n + 1) * sizeof(int32_t));
    if (!buf) {
        Py_DECREF(f);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        long v = PyLong_AsLong(PySequence_Fast_GET_ITEM(f, i));
        if (v == -1 && PyErr_Occurred()) {
            free(buf);
            Py_DECREF(f);
            return NULL;
        }
        buf[i] = (v < INT32_MIN || v > INT32_MAX) ? -1 : (int32_t)v;
    }
    int st = af_graph_set_outputs(self->g, buf, (int32_t)n);
    free(buf);
    Py_DECREF(f);
    if (st) return raise_status(st);
    Py_RETURN_NONE;
}

static PyObject *Graph_verify(GraphObject *self, PyObject *unused) {
    (void)unused;
    if (!graph_alive(self)) return NULL;
    int st = af_graph_verify(self->g);
    if (st) return raise_status(st);
    Py_RETURN_NONE;
}

static PyObject *graph_str(const af_graph *g) {
    char *text = NULL;
    int st = af_graph_print(g, &text);
    if (st) return raise_status(st);
    PyObject *s = PyUnicode_FromString(text);
    free(text);
    return s;
}

static PyObject *Graph_str(GraphObject *self) {
    if (!self->g) return PyUnicode_FromString("<aotfuse Graph (consumed by a Program)>");
    return graph_str(self->g);
}

/* [(op, kind), ...] for every node */
static PyObject *graph_nodes(const af_graph *g) {
    int32_t n = af_graph_num_nodes(g);
    PyObject *list = PyList_New(n);
    for (int32_t i = 0; list && i < n; i++) {
        const af_node *node = af_graph_node(g, i);
        PyObject *t = Py_BuildValue("(ss)", node->op, af_op_kind_name(af_op_get(node->op_id)->kind));
        if (!t) Py_CLEAR(list);
        else PyList_SET_ITEM(list, i, t);
    }
    return list;
}

static PyObject *Graph_nodes(GraphObject *self, PyObject *unused) {
    (void)unused;
    return graph_alive(self) ? graph_nodes(self->g) : NULL;
}

/* The value of g whose id is the Python int arg, or NULL with a Python error set. */
static const af_value *value_of_arg(const af_graph *g, PyObject *arg) {
    long id = PyLong_AsLong(arg);
    if (id == -1 && PyErr_Occurred()) return NULL;
    const af_value *v = af_graph_value(g, (int32_t)id);
    if (!v) PyErr_Format(PyExc_IndexError, "no value %ld", id);
    return v;
}

static PyObject *Graph_value_nbytes(GraphObject *self, PyObject *arg) {
    const af_value *v = graph_alive(self) ? value_of_arg(self->g, arg) : NULL;
    return v ? PyLong_FromLongLong(af_tensor_meta_nbytes(&v->meta)) : NULL;
}

/* value_meta(id) -> (dtype name, sizes, strides, storage offset), or None for a non-tensor. */
static PyObject *Graph_value_meta(GraphObject *self, PyObject *arg) {
    const af_value *v = graph_alive(self) ? value_of_arg(self->g, arg) : NULL;
    if (!v) return NULL;
    if (v->meta.type != AF_VALUE_TENSOR) Py_RETURN_NONE;
    PyObject *sizes = PyTuple_New(v->meta.ndim), *strides = PyTuple_New(v->meta.ndim);
    for (int32_t d = 0; sizes && strides && d < v->meta.ndim; d++) {
        PyTuple_SET_ITEM(sizes, d, PyLong_FromLongLong(v->meta.sizes[d]));
        PyTuple_SET_ITEM(strides, d, PyLong_FromLongLong(v->meta.strides[d]));
    }
    if (!sizes || !strides || PyErr_Occurred()) {
        Py_XDECREF(sizes);
        Py_XDECREF(strides);
        return NULL;
    }
    return Py_BuildValue("(sNNL)", af_dtype_name(v->meta.dtype), sizes, strides, (long long)v->meta.storage_offset);
}

static PyObject *Graph_get_counts(GraphObject *self, void *which) {
    if (!graph_alive(self)) return NULL;
    intptr_t w = (intptr_t)which;
    int32_t n = w == 0 ? af_graph_num_inputs(self->g) : w == 1 ? af_graph_num_nodes(self->g) : af_graph_num_outputs(self->g);
    return PyLong_FromLong(n);
}

static PyMethodDef Graph_methods[] = {
    {"add_input", (PyCFunction)Graph_add_input, METH_VARARGS, "add_input(name, meta) -> value id"},
    {"add_node", (PyCFunction)Graph_add_node, METH_VARARGS, "add_node(op, args, kwargs, metas) -> [value ids]"},
    {"set_outputs", (PyCFunction)Graph_set_outputs, METH_O, "set_outputs([value ids])"},
    {"verify", (PyCFunction)Graph_verify, METH_NOARGS, "raise aotfuse._C.Error if the graph is malformed"},
    {"nodes", (PyCFunction)Graph_nodes, METH_NOARGS, "[(op, kind), ...]"},
    {"value_nbytes", (PyCFunction)Graph_value_nbytes, METH_O, "bytes of a tensor value"},
    {"value_meta", (PyCFunction)Graph_value_meta, METH_O, "value_meta(id) -> (dtype, sizes, strides, storage offset) or None"},
    {NULL, NULL, 0, NULL}};

static PyGetSetDef Graph_getset[] = {
    {"num_inputs", (getter)Graph_get_counts, NULL, "number of inputs", (void *)0},
    {"num_nodes", (getter)Graph_get_counts, NULL, "number of nodes", (void *)1},
    {"num_outputs", (getter)Graph_get_counts, NULL, "number of outputs", (void *)2},
    {NULL, NULL, NULL, NULL, NULL}};

static PyTypeObject GraphType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "aotfuse._C.Graph",
    .tp_basicsize = sizeof(GraphObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "An aotfuse IR graph under construction.",
    .tp_new = Graph_new,
    .tp_dealloc = (destructor)Graph_dealloc,
    .tp_str = (reprfunc)Graph_str,
    .tp_repr = (reprfunc)Graph_str,
    .tp_methods = Graph_methods,
    .tp_getset = Graph_getset,
};

/* ---- Program ---- */

/* One run at a time: a program's value slots, scratch arrays and first-run checks are its own (the
 * core reports a run re-entered from its own extern calls). Kernels run without the GIL, so a second
 * thread may call run() meanwhile: it waits here, the GIL released, for the first to finish. */
typedef struct {
    PyObject_HEAD
    af_program *p;
    PyThread_type_lock run_lock;
    unsigned long runner; /* the thread ident running it, 0 when none (read and written under the GIL) */
} ProgramObject;

static PyObject *Program_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"graph", "fuse", "min_group", "devices", "reuse", "sink", "sink_reads", "window_sources", "merge",
                             "lazy_jit", "templates", "huge_pages", "sink_broadcasts", NULL};
    GraphObject *graph;
    af_program_options opts = {.fuse = 0, .min_group = 2};
    const char *devices = "all";
    int reuse = 1, sink = 1, sink_reads = 1, window_sources = 1, merge = 1, templates = 1, sink_broadcasts = 1;
    long long huge_pages = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!|pispppppppLp", kwlist, &GraphType, &graph, &opts.fuse, &opts.min_group,
                                     &devices, &reuse, &sink, &sink_reads, &window_sources, &merge, &opts.lazy_jit, &templates,
                                     &huge_pages, &sink_broadcasts) ||
        !graph_alive(graph))
        return NULL;
    if (huge_pages < 0) return PyErr_Format(PyExc_ValueError, "huge_pages must be >= 0 (bytes; 0: off), not %lld", huge_pages);
    opts.huge_pages_min = (int64_t)huge_pages;
    opts.no_reuse = !reuse;
    opts.no_sink = !sink;
    opts.no_sink_reads = !sink_reads;
    opts.no_sink_broadcasts = !sink_broadcasts;
    opts.no_shifted = !window_sources;
    opts.no_merge = !merge;
    opts.no_templates = !templates;
    if (strcmp(devices, "cpu") == 0) opts.device_types = 1u << AF_DEVICE_CPU;
    else if (strcmp(devices, "cuda") == 0) opts.device_types = 1u << AF_DEVICE_CUDA;
    else if (strcmp(devices, "all") == 0) opts.device_types = 0;
    else return PyErr_Format(PyExc_ValueError, "devices must be 'all', 'cpu' or 'cuda', not '%s'", devices);
    ProgramObject *self = (ProgramObject *)type->tp_alloc(type, 0);
    if (!self) return NULL;
    self->run_lock = PyThread_allocate_lock();
    if (!self->run_lock) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    int st = af_program_new(graph->g, &opts, &self->p);
    if (st) {
        Py_DECREF(self);
        return raise_status(st);
    }
    graph->g = NULL; /* the program owns it now */
    return (PyObject *)self;
}

static void Program_dealloc(ProgramObject *self) {
    af_program_free(self->p);
    if (self->run_lock) PyThread_free_lock(self->run_lock);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* run(inputs): a list is emptied (its references handed to the program, which drops each input
 * after its last use: AOTAutograd's boxed convention); any other sequence is only read. */
static PyObject *program_run(ProgramObject *self, PyObject *inputs) {
    const af_graph *g = af_program_graph(self->p);
    int32_t no = af_graph_num_outputs(g);
    af_obj **outs = PyMem_Calloc((size_t)no + 1, sizeof *outs);
    if (!outs) return PyErr_NoMemory();
    int st;
    if (PyList_CheckExact(inputs)) {
        Py_ssize_t n = PyList_GET_SIZE(inputs);
        af_obj **owned = PyMem_Calloc((size_t)n + 1, sizeof *owned);
        if (!owned) {
            PyMem_Free(outs);
            return PyErr_NoMemory();
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *item = PyList_GET_ITEM(inputs, i);
            Py_INCREF(item);
            owned[i] = (af_obj *)item;
        }
        if (PyList_SetSlice(inputs, 0, n, NULL) < 0) {
            for (Py_ssize_t i = 0; i < n; i++) Py_DECREF((PyObject *)owned[i]);
            PyMem_Free(owned);
            PyMem_Free(outs);
            return NULL;
        }
        st = af_program_run_owned(self->p, owned, (int32_t)n, outs);
        PyMem_Free(owned);
    } else {
        PyObject *f = PySequence_Fast(inputs, "run() takes a sequence of inputs");
        if (!f) {
            PyMem_Free(outs);
            return NULL;
        }
        st = af_program_run(self->p, (af_obj *const *)PySequence_Fast_ITEMS(f), (int32_t)PySequence_Fast_GET_SIZE(f), outs);
        Py_DECREF(f);
    }
    if (st) {
        PyMem_Free(outs);
        return raise_status(st);
    }
    PyObject *tuple = PyTuple_New(no);
    if (!tuple) {
        for (int32_t i = 0; i < no; i++) af_obj_release(outs[i]);
        PyMem_Free(outs);
        return NULL;
    }
    for (int32_t i = 0; i < no; i++) PyTuple_SET_ITEM(tuple, i, (PyObject *)outs[i]);
    PyMem_Free(outs);
    return tuple;
}

static PyObject *Program_run(ProgramObject *self, PyObject *inputs) {
    unsigned long me = PyThread_get_thread_ident();
    if (self->runner == me) return program_run(self, inputs); /* re-entered: the core says so */
    if (!PyThread_acquire_lock(self->run_lock, NOWAIT_LOCK)) {
        Py_BEGIN_ALLOW_THREADS
        PyThread_acquire_lock(self->run_lock, WAIT_LOCK);
        Py_END_ALLOW_THREADS
    }
    self->runner = me;
    PyObject *r = program_run(self, inputs);
    self->runner = 0;
    PyThread_release_lock(self->run_lock);
    return r;
}

static PyObject *Program_str(ProgramObject *self) { return graph_str(af_program_graph(self->p)); }

static PyObject *Program_nodes(ProgramObject *self, PyObject *unused) {
    (void)unused;
    return graph_nodes(af_program_graph(self->p));
}

static PyObject *Program_value_nbytes(ProgramObject *self, PyObject *arg) {
    const af_value *v = value_of_arg(af_program_graph(self->p), arg);
    return v ? PyLong_FromLongLong(af_tensor_meta_nbytes(&v->meta)) : NULL;
}

static int Program_set_check_inputs(ProgramObject *self, PyObject *value, void *closure) {
    (void)closure;
    int b = value ? PyObject_IsTrue(value) : -1;
    if (b < 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "cannot delete check_inputs");
        return -1;
    }
    af_program_set_check_inputs(self->p, b);
    return 0;
}

static int Program_set_profiling(ProgramObject *self, PyObject *value, void *closure) {
    (void)closure;
    int b = value ? PyObject_IsTrue(value) : -1;
    if (b < 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "cannot delete profiling");
        return -1;
    }
    int st = af_program_set_profiling(self->p, b);
    if (st) {
        raise_status(st);
        return -1;
    }
    return 0;
}

/* profile() -> (runs, [(kind "extern"/"kernel", op name or "", node index or kernel index, seconds), ...]) */
static PyObject *Program_profile(ProgramObject *self, PyObject *unused) {
    (void)unused;
    const af_graph *g = af_program_graph(self->p);
    PyObject *list = PyList_New(0);
    for (int32_t s = 0; list && s < af_program_num_steps(self->p); s++) {
        int32_t node = -1, group = -1;
        int64_t ns = af_program_profile(self->p, s, &node, &group);
        PyObject *t = node >= 0 ? Py_BuildValue("(ssid)", "extern", af_graph_node(g, node)->op, (int)node, ns < 0 ? 0.0 : ns * 1e-9)
                                : Py_BuildValue("(ssid)", "kernel", "", (int)group, ns < 0 ? 0.0 : ns * 1e-9);
        if (!t || PyList_Append(list, t) < 0) Py_CLEAR(list);
        Py_XDECREF(t);
    }
    if (!list) return NULL;
    return Py_BuildValue("(LN)", (long long)af_program_profiled_runs(self->p), list);
}

static PyObject *Program_get_num(ProgramObject *self, void *which) {
    const af_graph *g = af_program_graph(self->p);
    switch ((intptr_t)which) {
    case 0: return PyLong_FromLong(af_graph_num_inputs(g));
    case 1: return PyLong_FromLong(af_graph_num_nodes(g));
    case 2: return PyLong_FromLong(af_graph_num_outputs(g));
    case 3: return PyLong_FromLong(af_program_num_kernels(self->p));
    case 4: return PyLong_FromLongLong(af_program_kernel_fallbacks(self->p));
    case 5: return PyBool_FromLong(af_program_cache_hit(self->p));
    case 6: return PyLong_FromLong(af_program_num_steps(self->p));
    case 9: return PyLong_FromLong(af_program_buffer_reuses(self->p));
    case 10: return PyLong_FromLongLong(af_program_reuses_refused(self->p));
    case 11: return PyLong_FromLongLong(af_program_reused_bytes(self->p));
    case 12: return PyLong_FromLongLong(af_program_fresh_bytes(self->p));
    case 13: return PyLong_FromLongLong(af_program_reuses_taken(self->p));
    case 19: return PyLong_FromLongLong(af_program_huge_advised(self->p));
    case 14: return PyLong_FromLong(af_program_copies_sunk(self->p));
    case 15: return PyBool_FromLong(af_program_kernels_loaded(self->p));
    case 16: return PyLong_FromLong(af_program_bodies_reused(self->p));
    case 17: return PyLong_FromLong(af_program_bodies_lifted(self->p));
    case 18: {
        const char *src = af_program_compiled_source(self->p);
        if (!src) Py_RETURN_NONE;
        return PyUnicode_FromString(src);
    }
    case 8: {
        const char *src = af_program_cuda_source(self->p);
        if (!src) Py_RETURN_NONE;
        return PyUnicode_FromString(src);
    }
    default: {
        const char *src = af_program_source(self->p);
        if (!src) Py_RETURN_NONE;
        return PyUnicode_FromString(src);
    }
    }
}

/* [(op, kind, group or -1), ...]: which nodes ran fused */
static PyObject *Program_node_groups(ProgramObject *self, PyObject *unused) {
    (void)unused;
    const af_graph *g = af_program_graph(self->p);
    int32_t n = af_graph_num_nodes(g);
    PyObject *list = PyList_New(n);
    for (int32_t i = 0; list && i < n; i++) {
        const af_node *node = af_graph_node(g, i);
        PyObject *t = Py_BuildValue("(ssi)", node->op, af_op_kind_name(af_op_get(node->op_id)->kind),
                                    (int)af_program_node_group(self->p, i));
        if (!t) Py_CLEAR(list);
        else PyList_SET_ITEM(list, i, t);
    }
    return list;
}

static PyObject *Program_load_kernels(ProgramObject *self, PyObject *Py_UNUSED(ignored)) {
    int st = af_program_load_kernels(self->p);
    if (st) return raise_status(st);
    Py_RETURN_NONE;
}

static PyObject *Program_set_plain_outputs(ProgramObject *self, PyObject *arg) {
    long first = PyLong_AsLong(arg);
    if (first == -1 && PyErr_Occurred()) return NULL;
    af_program_set_plain_outputs(self->p, (int32_t)first);
    Py_RETURN_NONE;
}

static PyObject *Program_node_steps(ProgramObject *self, PyObject *unused) {
    (void)unused;
    int32_t n = af_graph_num_nodes(af_program_graph(self->p));
    PyObject *list = PyList_New(n);
    for (int32_t i = 0; list && i < n; i++) {
        PyObject *t = PyUnicode_FromString(af_program_node_how(self->p, i));
        if (!t) Py_CLEAR(list);
        else PyList_SET_ITEM(list, i, t);
    }
    return list;
}

/* 'kernel' for a value a kernel makes, else its producer's op */
static const char *made_by(const af_program *p, int32_t v) {
    const af_graph *g = af_program_graph(p);
    int32_t node = af_graph_value(g, v)->producer;
    if (node < 0) return "input";
    return af_program_node_group(p, node) >= 0 ? "kernel" : af_graph_node(g, node)->op;
}

/* [(value, donor value, made by, donor made by), ...]: the planned buffer reuses */
static PyObject *Program_buffer_donors(ProgramObject *self, PyObject *unused) {
    (void)unused;
    int32_t n = af_graph_num_values(af_program_graph(self->p));
    PyObject *list = PyList_New(0);
    for (int32_t v = 0; list && v < n; v++) {
        int32_t d = af_program_donor(self->p, v);
        if (d < 0) continue;
        PyObject *t = Py_BuildValue("(iiss)", (int)v, (int)d, made_by(self->p, v), made_by(self->p, d));
        if (!t || PyList_Append(list, t) < 0) Py_CLEAR(list);
        Py_XDECREF(t);
    }
    return list;
}

static PyMethodDef Program_methods[] = {
    {"buffer_donors", (PyCFunction)Program_buffer_donors, METH_NOARGS,
     "[(value, donor value, made by, donor made by), ...]: results that take the tensor of a value dead by "
     "then (buffer reuse); made by: 'kernel' or the extern's op"},
    {"load_kernels", (PyCFunction)Program_load_kernels, METH_NOARGS,
     "load_kernels(): compiles and loads a lazy_jit program's kernels now (nothing where they are loaded)"},
    {"set_plain_outputs", (PyCFunction)Program_set_plain_outputs, METH_O,
     "set_plain_outputs(first): outputs from index first on (saved activations, gradients) may be views "
     "made without ATen's dispatcher; earlier ones (by default all) stay ATen's views"},
    {"node_steps", (PyCFunction)Program_node_steps, METH_NOARGS,
     "per node, how it runs: 'kernel', 'aten' (an ATen call), 'folded' (a view kernels read through), "
     "'view' (a view made without ATen's dispatcher)"},
    {"profile", (PyCFunction)Program_profile, METH_NOARGS,
     "profile() -> (runs, [(kind, op, node or kernel index, seconds) per step]): host time per step while profiling is on"},
    {"run", (PyCFunction)Program_run, METH_O, "run(inputs) -> tuple of outputs (a list of inputs is emptied)"},
    {"nodes", (PyCFunction)Program_nodes, METH_NOARGS, "[(op, kind), ...]"},
    {"node_groups", (PyCFunction)Program_node_groups, METH_NOARGS, "[(op, kind, fusion group or -1), ...]"},
    {"value_nbytes", (PyCFunction)Program_value_nbytes, METH_O, "bytes of a tensor value"},
    {NULL, NULL, 0, NULL}};

static PyGetSetDef Program_getset[] = {
    {"num_inputs", (getter)Program_get_num, NULL, "number of inputs", (void *)0},
    {"num_nodes", (getter)Program_get_num, NULL, "number of graph nodes", (void *)1},
    {"num_steps", (getter)Program_get_num, NULL, "number of steps (extern calls + kernels)", (void *)6},
    {"num_kernels", (getter)Program_get_num, NULL, "fused kernels (generated; compiled by the first run where lazy_jit)", (void *)3},
    {"kernel_fallbacks", (getter)Program_get_num, NULL, "kernel calls that ran as extern calls", (void *)4},
    {"cache_hit", (getter)Program_get_num, NULL, "the kernels came from the disk cache", (void *)5},
    {"kernels_loaded", (getter)Program_get_num, NULL,
     "the kernels are compiled and loaded (or there are none); False before a lazy_jit program's first run", (void *)15},
    {"source", (getter)Program_get_num, NULL, "the generated C source, or None", (void *)7},
    {"compiled_source", (getter)Program_get_num, NULL,
     "the C source compiled for this program: source less the bodies found among earlier programs' (templates), "
     "or None when there is nothing to compile", (void *)18},
    {"bodies_reused", (getter)Program_get_num, NULL, "C kernel bodies called from earlier programs' modules (not compiled here)", (void *)16},
    {"bodies_lifted", (getter)Program_get_num, NULL,
     "C kernel bodies compiled with some sizes as arguments (templates for later shapes)", (void *)17},
    {"cuda_source", (getter)Program_get_num, NULL, "the generated CUDA source, or None", (void *)8},
    {"num_outputs", (getter)Program_get_num, NULL, "number of outputs", (void *)2},
    {"buffer_reuses", (getter)Program_get_num, NULL, "kernel outputs planned to take a dead intermediate's tensor", (void *)9},
    {"reuses_refused", (getter)Program_get_num, NULL, "runs' donors found held elsewhere (freshly allocated instead)", (void *)10},
    {"reuses_taken", (getter)Program_get_num, NULL, "results that took their donor's tensor, over all runs so far", (void *)13},
    {"huge_page_tensors", (getter)Program_get_num, NULL,
     "fresh CPU tensors of at least huge_pages bytes given transparent huge pages, over all runs so far", (void *)19},
    {"reused_bytes", (getter)Program_get_num, NULL, "bytes per run of the results planned to take a dead value's tensor", (void *)11},
    {"fresh_bytes", (getter)Program_get_num, NULL, "bytes per run of the intermediates (not outputs) allocated fresh", (void *)12},
    {"copies_sunk", (getter)Program_get_num, NULL, "copies of views of pointwise values, and kernel members' reads of them, computed from their sources", (void *)14},
    {"check_inputs", NULL, (setter)Program_set_check_inputs, "check inputs against the graph on each run", NULL},
    {"profiling", NULL, (setter)Program_set_profiling, "accumulate each step's host time (see profile())", NULL},
    {NULL, NULL, NULL, NULL, NULL}};

static PyTypeObject ProgramType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "aotfuse._C.Program",
    .tp_basicsize = sizeof(ProgramObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A planned, runnable aotfuse graph.",
    .tp_new = Program_new,
    .tp_dealloc = (destructor)Program_dealloc,
    .tp_str = (reprfunc)Program_str,
    .tp_repr = (reprfunc)Program_str,
    .tp_methods = Program_methods,
    .tp_getset = Program_getset,
};

/* ---- module functions ---- */

static PyObject *bridge_info(PyObject *m, PyObject *unused) {
    (void)m;
    (void)unused;
    int st = af_bridge_init();
    if (st) return raise_status(st);
    PyObject *d = PyDict_New();
    for (int i = 0; d && i < af_bridge_shim_count(); i++)
        if (PyDict_SetItemString(d, af_bridge_shim_name(i), af_bridge_shim_found(i) ? Py_True : Py_False) < 0)
            Py_CLEAR(d);
    return d;
}

static PyObject *fast_bindings(PyObject *m, PyObject *unused) {
    (void)m;
    (void)unused;
    PyObject *l = PyList_New(0);
    const char *op, *binding;
    int out;
    for (int i = 0; l && (op = af_bridge_fast_binding(i, &binding, &out)); i++) {
        PyObject *t = Py_BuildValue("(ssO)", op, binding, out ? Py_True : Py_False);
        if (!t || PyList_Append(l, t) < 0) Py_CLEAR(l);
        Py_XDECREF(t);
    }
    return l;
}

static PyObject *op_kind(PyObject *m, PyObject *arg) {
    (void)m;
    const char *name = PyUnicode_AsUTF8(arg);
    if (!name) return NULL;
    return PyUnicode_FromString(af_op_kind_name(af_op_get(af_op_lookup(name))->kind));
}

/* partition(graph, roles, num_fwd_outputs, min_cut=True, max_dist_from_bw=.., reduction_ratio=..,
 *           ban_materialized_bw=.., ban_chained_random=.., ban_chained_materialized=.., ban_scalar_calls=..,
 *           node_policy=None, memory_budget=1.0) -> dict(saved=[value ids], forward=[node idx], backward=[node idx in
 *           run order], recomputed=int, saved_bytes=int, cut_value=int) */
static PyObject *partition(PyObject *m, PyObject *args, PyObject *kwds) {
    (void)m;
    static char *kwlist[] = {"graph", "roles", "num_fwd_outputs", "min_cut", "max_dist_from_bw", "reduction_ratio",
                             "ban_materialized_bw", "ban_chained_random", "ban_chained_materialized", "node_policy",
                             "memory_budget", "ban_scalar_calls", NULL};
    GraphObject *graph;
    Py_buffer roles, policy = {0};
    int nfwd, min_cut = 1;
    af_partition_options o = af_partition_default_options();
    long long max_dist = o.max_dist_from_bw;
    int ratio = o.reduction_ratio, ban_bw = o.ban_materialized_bw, ban_random = o.ban_chained_random;
    int ban_chain = o.ban_chained_materialized, ban_calls = o.ban_scalar_calls;
    double budget = o.memory_budget;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!y*i|pLiiipz*di", kwlist, &GraphType, &graph, &roles, &nfwd, &min_cut,
                                     &max_dist, &ratio, &ban_bw, &ban_random, &ban_chain, &policy, &budget, &ban_calls))
        return NULL;
    PyObject *result = NULL;
    af_partition *p = NULL;
    if (!graph_alive(graph)) goto done;
    if (roles.len != af_graph_num_inputs(graph->g)) {
        PyErr_Format(PyExc_ValueError, "%zd roles for %d graph inputs", roles.len, (int)af_graph_num_inputs(graph->g));
        goto done;
    }
    if (policy.buf) {
        if (policy.len != af_graph_num_nodes(graph->g)) {
            PyErr_Format(PyExc_ValueError, "node_policy has %zd entries for %d nodes", policy.len,
                         (int)af_graph_num_nodes(graph->g));
            goto done;
        }
        for (Py_ssize_t i = 0; i < policy.len; i++)
            if (((const uint8_t *)policy.buf)[i] > AF_POLICY_SAVE) {
                PyErr_Format(PyExc_ValueError, "node_policy[%zd] is %d: 0 (none), 1 (recompute) or 2 (save)", i,
                             (int)((const uint8_t *)policy.buf)[i]);
                goto done;
            }
        o.node_policy = policy.buf;
    }
    o.memory_budget = budget;
    o.max_dist_from_bw = max_dist;
    o.reduction_ratio = ratio;
    o.ban_materialized_bw = ban_bw;
    o.ban_chained_random = ban_random;
    o.ban_chained_materialized = ban_chain;
    o.ban_scalar_calls = ban_calls;
    int st = min_cut ? af_partition_min_cut(graph->g, roles.buf, nfwd, &o, &p)
                     : af_partition_default_policy(graph->g, roles.buf, nfwd, o.node_policy, &p);
    if (!st) st = af_partition_check(graph->g, roles.buf, nfwd, p);
    if (st) {
        raise_status(st);
        goto done;
    }
    PyObject *saved = PyList_New(p->n_saved), *fw = PyList_New(0), *bw = PyList_New(p->n_backward_order);
    if (saved && fw && bw) {
        for (int32_t i = 0; i < p->n_saved; i++) PyList_SET_ITEM(saved, i, PyLong_FromLong(p->saved[i]));
        for (int32_t i = 0; i < p->n_backward_order; i++) PyList_SET_ITEM(bw, i, PyLong_FromLong(p->backward_order[i]));
        for (int32_t n = 0; n < af_graph_num_nodes(graph->g); n++) {
            if (!p->in_forward[n]) continue;
            PyObject *idx = PyLong_FromLong(n);
            if (!idx || PyList_Append(fw, idx) < 0) {
                Py_XDECREF(idx);
                goto build_failed;
            }
            Py_DECREF(idx);
        }
        result = Py_BuildValue("{s:O,s:O,s:O,s:i,s:L,s:L}", "saved", saved, "forward", fw, "backward", bw,
                               "recomputed", (int)p->n_recomputed, "saved_bytes", (long long)p->saved_bytes,
                               "cut_value", (long long)p->cut_value);
    }
build_failed:
    Py_XDECREF(saved);
    Py_XDECREF(fw);
    Py_XDECREF(bw);
done:
    af_partition_free(p);
    PyBuffer_Release(&roles);
    if (policy.buf) PyBuffer_Release(&policy);
    return result;
}

/* ---- CUDA without a GPU: code generation and NVRTC, for checks and reports ---- */

/* A new list of ints (NULL with an exception set when out of memory). */
static PyObject *id_list(const int32_t *ids, int32_t n) {
    PyObject *list = PyList_New(n);
    for (int32_t k = 0; list && k < n; k++) {
        PyObject *item = PyLong_FromLong(ids[k]);
        if (!item) Py_CLEAR(list);
        else PyList_SET_ITEM(list, k, item);
    }
    return list;
}

static const char *const cuda_kind_names[] = {"none", "pointwise", "rows", "columns", "split_rows"};

/* cuda_codegen(graph, sm_count=132, min_group=2, window_sources=True, merge=True) -> (source, [launch dict per
 * group]): the CUDA a program would compile for the graph's CUDA groups (a program's graph: after
 * sink_copies; window_sources: af_fuse_options' no_shifted, negated), and per
 * group its launch facts and operands (value ids: inputs, then outputs, the kernel's parameter
 * order); the graph is not consumed. */
static PyObject *cuda_codegen(PyObject *m, PyObject *args, PyObject *kwds) {
    (void)m;
    static char *kwlist[] = {"graph", "sm_count", "min_group", "window_sources", "merge", NULL};
    GraphObject *graph;
    int sm_count = 132, min_group = 2, window_sources = 1, merge = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!|iipp", kwlist, &GraphType, &graph, &sm_count, &min_group, &window_sources,
                                     &merge) ||
        !graph_alive(graph))
        return NULL;
    int st = af_graph_verify(graph->g);
    if (st) return raise_status(st);
    const af_graph *g = graph->g;
    af_fuse_options fo = {.min_nodes = min_group, .device_types = 1u << AF_DEVICE_CUDA, .no_shifted = !window_sources,
                          .no_merge = !merge};
    af_fusion_plan *plan = NULL;
    if ((st = af_fuse_plan_new(g, &fo, &plan))) return raise_status(st);
    af_cuda_launch *launch = calloc((size_t)plan->n_groups + 1, sizeof *launch);
    char *source = NULL;
    if (!launch) st = af_error_set(AF_ERR_NOMEM, "out of memory");
    else st = af_codegen_cuda(g, plan, sm_count, &source, launch);
    PyObject *result = NULL, *list = st ? NULL : PyList_New(0);
    for (int32_t i = 0; list && i < plan->n_groups; i++) {
        const af_cuda_launch *l = &launch[i];
        const af_fusion_group *grp = &plan->groups[i];
        PyObject *ins = id_list(grp->inputs, grp->n_inputs), *outs = id_list(grp->outputs, grp->n_outputs);
        PyObject *streams = PyList_New(l->n_streams);
        for (int32_t j = 0; streams && j < l->n_streams; j++) {
            PyObject *v = PyLong_FromUnsignedLongLong((unsigned long long)l->streams[j]);
            if (!v) Py_CLEAR(streams);
            else PyList_SET_ITEM(streams, j, v);
        }
        PyObject *d = ins && outs && streams
                          ? Py_BuildValue("{s:s,s:i,s:L,s:L,s:i,s:L,s:L,s:i,s:O,s:O,s:i,s:O}", "kind", cuda_kind_names[l->kind],
                                          "threads", (int)l->threads, "blocks", (long long)l->blocks, "vec_blocks",
                                          (long long)l->vec_blocks, "split", (int)l->split, "finish_blocks",
                                          (long long)l->finish_blocks, "workspace", (long long)l->workspace, "nodes",
                                          (int)grp->n_nodes, "inputs", ins, "outputs", outs, "body", (int)l->body, "streams", streams)
                          : NULL;
        Py_XDECREF(ins);
        Py_XDECREF(outs);
        Py_XDECREF(streams);
        if (!d || PyList_Append(list, d) < 0) Py_CLEAR(list);
        Py_XDECREF(d);
    }
    if (list) result = Py_BuildValue("(sN)", source, list);
    free(source);
    free(launch);
    af_fuse_plan_free(plan);
    return st ? raise_status(st) : result;
}

/* sink_copies(graph, devices="all", reads=True, broadcasts=True) -> (Graph or None, [origin per
 * value]): the graph a program runs once copies of views (and, with reads, kernel members' reads of
 * them; with broadcasts, their reads of smaller pointwise values) are computed from their sources
 * (fuse.h, af_sink_copies), None when nothing qualifies; per value of the new graph, the value of `graph` it stands for (-1: a recomputed
 * intermediate). The given graph is not consumed. */
static PyObject *sink_copies(PyObject *m, PyObject *args, PyObject *kwds) {
    (void)m;
    static char *kwlist[] = {"graph", "devices", "reads", "broadcasts", NULL};
    GraphObject *graph;
    const char *devices = "all";
    int reads = 1, broadcasts = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!|spp", kwlist, &GraphType, &graph, &devices, &reads, &broadcasts) ||
        !graph_alive(graph))
        return NULL;
    uint32_t mask = strcmp(devices, "cpu") == 0 ? 1u << AF_DEVICE_CPU : strcmp(devices, "cuda") == 0 ? 1u << AF_DEVICE_CUDA : 0;
    if (!mask && strcmp(devices, "all") != 0) return PyErr_Format(PyExc_ValueError, "devices must be 'all', 'cpu' or 'cuda'");
    af_graph *sunk = NULL;
    int32_t *origin = NULL;
    int st = af_graph_verify(graph->g);
    int which = (reads ? AF_SINK_VIEW_READS : 0) | (broadcasts ? AF_SINK_BROADCAST_READS : 0);
    if (!st) st = af_sink_copies(graph->g, mask, which, &sunk, NULL, &origin);
    if (st) return raise_status(st);
    if (!sunk) return Py_BuildValue("(OO)", Py_None, Py_None);
    GraphObject *out = (GraphObject *)GraphType.tp_alloc(&GraphType, 0);
    PyObject *list = out ? PyList_New(af_graph_num_values(sunk)) : NULL;
    for (int32_t v = 0; list && v < af_graph_num_values(sunk); v++) {
        PyObject *o = PyLong_FromLong(origin[v]);
        if (!o) Py_CLEAR(list);
        else PyList_SET_ITEM(list, v, o);
    }
    free(origin);
    if (!list) {
        Py_XDECREF(out);
        af_graph_free(sunk);
        return NULL;
    }
    out->g = sunk;
    return Py_BuildValue("(NN)", (PyObject *)out, list);
}

/* nvrtc_compile(source, arch=90, ptx=False, verbose=False) -> (image bytes, log str) */
static PyObject *nvrtc_compile(PyObject *m, PyObject *args, PyObject *kwds) {
    (void)m;
    static char *kwlist[] = {"source", "arch", "ptx", "verbose", NULL};
    const char *source;
    int arch = 90, ptx = 0, verbose = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "s|ipp", kwlist, &source, &arch, &ptx, &verbose)) return NULL;
    char *image = NULL, *log = NULL;
    size_t size = 0;
    int st;
    Py_BEGIN_ALLOW_THREADS
    st = af_nvrtc_compile(source, arch, ptx, verbose, &image, &size, &log);
    Py_END_ALLOW_THREADS
    if (st) return raise_status(st);
    PyObject *r = Py_BuildValue("(y#s)", image, (Py_ssize_t)size, log ? log : "");
    free(image);
    free(log);
    return r;
}

/* cuda_info(need_driver=False) -> {"nvrtc": path, "nvrtc_version": int} or {"error": why} */
static PyObject *cuda_info(PyObject *m, PyObject *args) {
    (void)m;
    int need_driver = 0;
    if (!PyArg_ParseTuple(args, "|p", &need_driver)) return NULL;
    int st = af_cuda_load(need_driver);
    if (st) return Py_BuildValue("{s:s}", "error", af_error_message());
    return Py_BuildValue("{s:s,s:i}", "nvrtc", af_nvrtc_path(), "nvrtc_version", af_nvrtc_version());
}

static PyObject *cuda_add_search_dir(PyObject *m, PyObject *arg) {
    (void)m;
    const char *dir = PyUnicode_AsUTF8(arg);
    if (!dir) return NULL;
    int st = af_cuda_add_search_dir(dir);
    if (st) return raise_status(st);
    Py_RETURN_NONE;
}

static PyObject *op_table(PyObject *m, PyObject *unused) {
    (void)m;
    (void)unused;
    PyObject *list = PyList_New(0);
    for (int i = 1; list && i < AF_OP_COUNT; i++) {
        const af_op_info *info = af_op_get((af_op_id)i);
        PyObject *t = Py_BuildValue("(ssz)", info->name, af_op_kind_name(info->kind), info->c_expr);
        if (!t || PyList_Append(list, t) < 0) Py_CLEAR(list);
        Py_XDECREF(t);
    }
    return list;
}

static PyObject *kernel_templates(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyLong_FromLong(af_tmpl_count());
}

static PyMethodDef module_methods[] = {
    {"kernel_templates", kernel_templates, METH_NOARGS, "C kernel bodies of live programs that later programs may call (templates)"},
    {"op_table", op_table, METH_NOARGS, "[(name, kind, C expression or None), ...]"},
    {"partition", (PyCFunction)(void (*)(void))partition, METH_VARARGS | METH_KEYWORDS,
     "partition(graph, roles: bytes, num_fwd_outputs, min_cut=True, ...) -> dict"},
    {"bridge_info", bridge_info, METH_NOARGS, "{shim function: found in this torch}"},
    {"fast_bindings", fast_bindings, METH_NOARGS, "[(ATen overload, the torch.<name> binding extern calls use for it, whether out= calls use it too)]"},
    {"op_kind", op_kind, METH_O, "op_kind('aten::add.Tensor') -> 'pointwise'"},
    {"sink_copies", (PyCFunction)(void (*)(void))sink_copies, METH_VARARGS | METH_KEYWORDS,
     "sink_copies(graph, devices='all', reads=True, broadcasts=True) -> (Graph or None, [origin per value]): copies (and reads) of views, and reads of broadcast values, computed from their sources"},
    {"cuda_codegen", (PyCFunction)(void (*)(void))cuda_codegen, METH_VARARGS | METH_KEYWORDS,
     "cuda_codegen(graph, sm_count=132, min_group=2, window_sources=True, merge=True) -> (CUDA source, [launch per group])"},
    {"nvrtc_compile", (PyCFunction)(void (*)(void))nvrtc_compile, METH_VARARGS | METH_KEYWORDS,
     "nvrtc_compile(source, arch=90, ptx=False, verbose=False) -> (image, log)"},
    {"cuda_info", cuda_info, METH_VARARGS, "cuda_info(need_driver=False) -> NVRTC's path and version, or the error"},
    {"cuda_add_search_dir", cuda_add_search_dir, METH_O, "a folder to look for libnvrtc in"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "aotfuse._C", "aotfuse's C core.", -1, module_methods,
                                        NULL, NULL, NULL, NULL};

/* The CPU JIT's wait for a compiler, interrupted by a signal: Python's handlers run (the GIL is held
 * while kernels are built), and one that raised (KeyboardInterrupt) stops the build; the exception
 * stays set, so raise_status raises it. */
static int python_signal_raised(void) { return PyErr_CheckSignals() < 0; }

PyMODINIT_FUNC PyInit__C(void) {
    if (PyType_Ready(&GraphType) < 0 || PyType_Ready(&ProgramType) < 0) return NULL;
    af_jit_set_interrupt_check(python_signal_raised);
    PyObject *m = PyModule_Create(&module_def);
    if (!m) return NULL;
    AotfuseError = PyErr_NewExceptionWithDoc("aotfuse._C.Error", "An error reported by aotfuse's C core.",
                                             PyExc_RuntimeError, NULL);
    if (!AotfuseError || PyModule_AddObjectRef(m, "Error", AotfuseError) < 0 ||
        PyModule_AddObjectRef(m, "Graph", (PyObject *)&GraphType) < 0 ||
        PyModule_AddObjectRef(m, "Program", (PyObject *)&ProgramType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
