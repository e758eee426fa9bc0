/* The aotfuse IR: a graph of values and nodes, owned by one arena.
 *
 * A graph has inputs (values with no producer), nodes (one op each, with arguments and
 * one or more output values) and an ordered output list. Nodes are appended in execution
 * order; every argument refers to a value defined earlier. All strings, argument arrays and
 * shape arrays live in the graph's arena: af_graph_free releases everything at once, and no
 * pointer handed out by a graph outlives it.
 *
 * Builders copy what they are given. Every function returns an AF_* status; on error the
 * graph is unchanged and af_error_message() says why.
 */
#ifndef AOTFUSE_IR_H
#define AOTFUSE_IR_H

#include <stddef.h>
#include <stdint.h>

#include "aotfuse/ops.h"
#include "aotfuse/status.h"

#define AF_MAX_DIMS 16

typedef enum {
    AF_DTYPE_FLOAT32 = 0,
    AF_DTYPE_FLOAT64,
    AF_DTYPE_FLOAT16,
    AF_DTYPE_BFLOAT16,
    AF_DTYPE_INT64,
    AF_DTYPE_INT32,
    AF_DTYPE_INT16,
    AF_DTYPE_INT8,
    AF_DTYPE_UINT8,
    AF_DTYPE_BOOL,
    AF_DTYPE_COMPLEX64,
    AF_DTYPE_COMPLEX128,
    AF_DTYPE_UINT64, /* opaque: only extern calls carry it (CUDA attention's random state) */
    AF_DTYPE_COUNT
} af_dtype;

typedef enum { AF_DEVICE_CPU = 0, AF_DEVICE_CUDA, AF_DEVICE_META, AF_DEVICE_COUNT } af_device_type;

typedef struct {
    af_device_type type;
    int32_t index; /* -1: unspecified */
} af_device;

/* What a value is. Tensors carry full metadata; "other" is any non-tensor an op may return
 * (None in a tuple of gradients, say), carried through untouched. */
typedef enum { AF_VALUE_TENSOR = 0, AF_VALUE_OTHER } af_value_type;

typedef struct {
    af_value_type type;
    af_dtype dtype;
    af_device device;
    int32_t ndim;
    const int64_t *sizes;   /* ndim entries, arena-owned */
    const int64_t *strides; /* ndim entries, arena-owned */
    int64_t storage_offset;
} af_tensor_meta;

typedef struct {
    const char *name;   /* arena-owned, never NULL */
    af_tensor_meta meta;
    int32_t producer;   /* node index, or -1 for a graph input */
    int32_t out_index;  /* which output of the producer */
} af_value;

typedef enum {
    AF_ARG_VALUE = 0, /* a value of the graph */
    AF_ARG_NONE,
    AF_ARG_BOOL,
    AF_ARG_INT,
    AF_ARG_FLOAT,
    AF_ARG_STR,
    AF_ARG_DTYPE,
    AF_ARG_DEVICE,
    AF_ARG_LAYOUT,        /* enum name in `s`: "strided", ... */
    AF_ARG_MEMORY_FORMAT, /* enum name in `s`: "contiguous_format", ... */
    AF_ARG_LIST,          /* items, possibly nested or mixed (Tensor?[]) */
    AF_ARG_COMPLEX,       /* a Python complex (`z * 1j`, a complex fill): ATen calls only */
    AF_ARG_COUNT
} af_arg_kind;

typedef struct af_arg {
    af_arg_kind kind;
    const char *name; /* keyword name, or NULL for a positional argument; arena-owned */
    union {
        int32_t value;  /* AF_ARG_VALUE */
        int64_t i;      /* AF_ARG_INT, AF_ARG_BOOL */
        double f;       /* AF_ARG_FLOAT */
        struct {
            double re, im;
        } c;            /* AF_ARG_COMPLEX */
        const char *s;  /* AF_ARG_STR, AF_ARG_LAYOUT, AF_ARG_MEMORY_FORMAT */
        af_dtype dtype; /* AF_ARG_DTYPE */
        af_device device;
        struct {
            int32_t n;
            struct af_arg *items;
        } list;
    } u;
} af_arg;

typedef struct {
    const char *op;   /* qualified ATen name with overload: "aten::add.Tensor"; arena-owned */
    af_op_id op_id;   /* table entry, AF_OP_UNKNOWN for externs */
    int32_t n_args;
    af_arg *args;     /* positional first, then keyword; arena-owned */
    int32_t n_outputs;
    int32_t first_output; /* outputs are values first_output .. first_output + n_outputs - 1 */
} af_node;

typedef struct af_graph af_graph;

/* A new empty graph in *out. */
int af_graph_new(af_graph **out);

/* Frees the graph and everything its arena holds. NULL is allowed. */
void af_graph_free(af_graph *g);

/* Appends an input; its value id in *value_id. `name` may be NULL (a name is made up). */
int af_graph_add_input(af_graph *g, const char *name, const af_tensor_meta *meta, int32_t *value_id);

/* Appends a node computing `op` from `args` (deep-copied), with n_outputs results described by
 * metas. Arguments must refer to existing values. The first output's id goes in *first_output. */
int af_graph_add_node(af_graph *g, const char *op, const af_arg *args, int32_t n_args,
                      const af_tensor_meta *metas, int32_t n_outputs, int32_t *first_output);

/* Sets the graph's outputs (value ids, copied); may repeat ids and name inputs. */
int af_graph_set_outputs(af_graph *g, const int32_t *value_ids, int32_t n);

/* Checks every invariant above, and the metadata of each value. AF_OK or AF_ERR_INVALID. */
int af_graph_verify(const af_graph *g);

/* Writes a readable listing into a malloc'd string at *text (the caller frees it). */
int af_graph_print(const af_graph *g, char **text);

/* Read access. Pointers stay valid until the graph is freed or grows (add_*). */
int32_t af_graph_num_inputs(const af_graph *g);
int32_t af_graph_num_values(const af_graph *g);
int32_t af_graph_num_nodes(const af_graph *g);
int32_t af_graph_num_outputs(const af_graph *g);
const af_value *af_graph_value(const af_graph *g, int32_t id);
const af_node *af_graph_node(const af_graph *g, int32_t index);
int32_t af_graph_input(const af_graph *g, int32_t index);  /* value id of the index-th input */
int32_t af_graph_output(const af_graph *g, int32_t index); /* value id of the index-th output */

/* Elements of a tensor (the product of its sizes; 1 for a 0-dim tensor). */
int64_t af_tensor_meta_numel(const af_tensor_meta *meta);
/* Whether meta is a tensor with elements that fill their span, none shared (its strides, of the
 * dims longer than 1 taken smallest first, each the product of the sizes inside): then the
 * element at offset f from its start has coordinates (f / stride[d]) % size[d]. 0 with no elements. */
int af_tensor_meta_dense(const af_tensor_meta *meta);

/* Whether a and b lay out the same elements the same way: dtype, sizes, storage offset and strides
 * (with exact 0, the strides of size-1 dims aside, which address nothing). */
int af_tensor_meta_same_layout(const af_tensor_meta *a, const af_tensor_meta *b, int exact);

/* The value v's views come from, up the chain of view nodes (their first argument): v itself
 * when no view made it. */
int32_t af_graph_view_root(const af_graph *g, int32_t v);

/* Bytes of a tensor value's elements (numel * itemsize); 0 for non-tensors. */
int64_t af_tensor_meta_nbytes(const af_tensor_meta *meta);

/* Names: "float32", "cpu", ... and their parsers (AF_ERR_UNSUPPORTED for unknown names). */
const char *af_dtype_name(af_dtype dtype);
int af_dtype_itemsize(af_dtype dtype);
int af_dtype_parse(const char *name, af_dtype *out);
const char *af_device_type_name(af_device_type type);
int af_device_type_parse(const char *name, af_device_type *out);

#endif
