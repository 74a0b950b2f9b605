/* The direct launch of a kept Triton kernel: its key and its launch in one C call (autosel/ops/triton_launch/__init__.py).

   Built at first use with Triton's own helper for its launchers (triton.runtime.build.compile_module_from_src),
   from Python's headers alone: the few CUDA driver declarations it needs are below, and libcuda is opened at the
   first launch, so the module also builds and keys arguments on a machine without CUDA.

   key(prefix, args) -> (prefix, codes, dtype, ...) or None
       What Triton specializes each argument on, as one tuple: a byte per argument (its kind and flags) and the
       dtype of each tensor. None when an argument is of a kind this module does not key (Triton's path then).
   launch(kept, prefix, grid, stream, args) -> bool
       Looks key(prefix, args) up in the dict `kept`; when an entry is there, launches it on `stream` and returns
       True. False when there is none (or an argument is not a CUDA tensor, or no CUDA context is current): the
       caller then launches through Triton.
   param_sizes(function) -> tuple of int
       The byte size of each parameter of a loaded kernel (cuFuncGetParamInfo), to check an entry against.
   reads_dlpack() -> bool
       Whether tensors are read through torch's DLPack C exchange API (torch.Tensor.__dlpack_c_exchange_api__, a
       capsule; torch 2.11 and 2.13 have it): a tensor's address, dtype, device, shape and strides in one C call,
       where the attributes cost a Python call each. Without it tensors are read through their attributes, and
       norm(), act_and_mul() and rope() launch nothing (they return False).
   norm(kept, plans, x, residual, weight, out, eps) -> bool
   act_and_mul(kept, plans, x, out, gelu) -> bool
   rope(kept, plans, positions, query, key, head_size, cos_sin_cache, is_neox) -> bool
       autosel's Triton kernels for rmsnorm (residual None) or fused add + rmsnorm (out is x), silu/gelu_and_mul
       and rope, launched from their tensors as triton_kernels launches them from Python: the views, the checks,
       the plan and the key in C. False, having launched nothing, wherever the Python path could differ (an
       argument it would copy, reject or key otherwise; a shape not planned yet, `plans` being what that path
       recorded; a kernel not kept yet): the caller then takes that path.

   An entry is (function, threads per block, shared memory bytes, kinds, trailing null pointers, the compiled
   kernel, held so that its module stays loaded): kinds has one
   character per argument saying how it is passed: 'p' a tensor's address, 'i' int32, 'l' int64, 'K' uint64,
   'f' float32, 'b' one byte, '-' not passed (Triton made it a constant). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <stdint.h>
#include <string.h>

typedef int CUresult;
typedef struct CUfunc_st *CUfunction;
typedef struct CUstream_st *CUstream;
typedef struct CUctx_st *CUcontext;
typedef CUresult (*launch_t)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                             CUstream, void **, void **);
typedef CUresult (*ctx_current_t)(CUcontext *);
typedef CUresult (*error_string_t)(CUresult, const char **);
typedef CUresult (*param_info_t)(CUfunction, size_t, size_t *, size_t *);
typedef CUresult (*ctx_device_t)(int *);

/* DLPack 1.x (dlpack.h), the part of its C exchange API used here. */
typedef struct { int32_t device_type; int32_t device_id; } DLDevice;
typedef struct { uint8_t code; uint8_t bits; uint16_t lanes; } DLDataType;
typedef struct {
    void *data;
    DLDevice device;
    int32_t ndim;
    DLDataType dtype;
    int64_t *shape;
    int64_t *strides;  /* NULL: compact and row-major */
    uint64_t byte_offset;
} DLTensor;
typedef struct { uint32_t major; uint32_t minor; } DLPackVersion;
typedef struct DLPackExchangeAPIHeader {
    DLPackVersion version;
    struct DLPackExchangeAPIHeader *prev_api;
} DLPackExchangeAPIHeader;
typedef struct {
    DLPackExchangeAPIHeader header;
    void *managed_tensor_allocator;
    void *managed_tensor_from_py_object_no_sync;
    void *managed_tensor_to_py_object_no_sync;
    int (*dltensor_from_py_object_no_sync)(void *py_object, DLTensor *out);
    int (*current_work_stream)(int32_t device_type, int32_t device_id, void **out_current_stream);
} DLPackExchangeAPI;
/* The DLPack device type launched on (kDLCUDA) and the driver library; a test builds this file with
   AUTOSEL_DL_DEVICE 1 (kDLCPU) and a stand-in driver that records launches, to compare the C launches with the
   Python path's on a machine without a GPU (tests/test_triton_launch_c.py). */
#ifndef AUTOSEL_DL_DEVICE
#define AUTOSEL_DL_DEVICE 2
#endif
#ifndef AUTOSEL_LIBCUDA
#define AUTOSEL_LIBCUDA "libcuda.so.1"
#endif
enum { DL_CUDA = AUTOSEL_DL_DEVICE };
enum { DL_FLOAT_CODE = 2 };  /* kDLFloat: float16 and float32 (bfloat16 is kDLBfloat) */

#define MAX_ARGS 32
#define MAX_NULLS 8

/* The byte of an argument's kind in a key; the low bits are its flags. */
enum { TENSOR = 0x10, INT = 0x20, FLOAT = 0x40, BOOL = 0x50, NONE = 0x60 };
enum { ALIGNED = 1 };                                    /* a tensor's address is a multiple of 16 bytes */
enum { ONE = 1, DIV16 = 2, I32 = 4, U64 = 8 };          /* an int: equal to 1, divisible by 16, its width */

static PyObject *data_ptr_name, *dtype_name, *is_cuda_name;
static PyTypeObject *tensor_type;
static launch_t cu_launch;
static ctx_current_t cu_ctx_current;
static error_string_t cu_error_string;
static param_info_t cu_param_info;
static ctx_device_t cu_ctx_device;
static const DLPackExchangeAPI *dlpack;  /* NULL: tensors are read through their attributes */

typedef union {
    uint64_t u64;
    int64_t i64;
    int32_t i32;
    uint8_t u8;
    float f32;
} Value;

static int open_driver(void) {
    if (cu_launch != NULL) return 1;
    void *lib = dlopen(AUTOSEL_LIBCUDA, RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL) return 0;
    cu_ctx_current = (ctx_current_t)dlsym(lib, "cuCtxGetCurrent");
    cu_error_string = (error_string_t)dlsym(lib, "cuGetErrorString");
    cu_param_info = (param_info_t)dlsym(lib, "cuFuncGetParamInfo");  /* CUDA 12.4 and later */
    cu_ctx_device = (ctx_device_t)dlsym(lib, "cuCtxGetDevice");
    launch_t launch = (launch_t)dlsym(lib, "cuLaunchKernel");
    if (cu_ctx_current == NULL || cu_error_string == NULL || cu_ctx_device == NULL || launch == NULL) return 0;
    cu_launch = launch;
    return 1;
}

/* A tensor's dtype in a key when read through DLPack: its type code, bits and lanes as one int. */
static PyObject *dtype_code(DLDataType dtype) {
    return PyLong_FromUnsignedLong(dtype.code | (unsigned long)dtype.bits << 8 | (unsigned long)dtype.lanes << 16);
}

/* Reads obj through torch's DLPack exchange: 1, or 0 (no exception set) where DLPack cannot describe it. */
static int dl_read(PyObject *obj, DLTensor *t) {
    if (dlpack->dltensor_from_py_object_no_sync(obj, t) == 0) return 1;
    PyErr_Clear();  /* the Python path, or Triton's, says what is wrong with it */
    return 0;
}

/* A tensor argument read through DLPack: its address in *value, its code in *code, and its dtype for the key (a new
   reference; NULL on an error). */
static PyObject *dl_arg(const DLTensor *t, Value *value, char *code) {
    value->u64 = (uint64_t)(uintptr_t)t->data + t->byte_offset;
    *code = TENSOR | ((value->u64 & 15) == 0 ? ALIGNED : 0);
    return dtype_code(t->dtype);
}

/* An integer argument's code, as read_args gives it. */
static char int_code(long long v) {
    return INT | (v == 1 ? ONE : 0) | ((v & 15) == 0 ? DIV16 : 0) | (v >= -2147483648LL && v < 2147483648LL ? I32 : 0);
}

/* Fills codes, values and the tensors' dtypes (new references in dtypes[0..*n_dtypes)) for each argument.
   Returns 0 when an argument cannot be keyed (no exception set), -1 on a Python error, 1 otherwise.
   With need_cuda, a tensor not on a CUDA device also returns 0. */
static int read_args(PyObject *args, int need_cuda, char *codes, Value *values, PyObject **dtypes, int *n_dtypes) {
    Py_ssize_t n = PyTuple_GET_SIZE(args);
    *n_dtypes = 0;
    if (n > MAX_ARGS) return 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *arg = PyTuple_GET_ITEM(args, i);
        if (dlpack != NULL && PyObject_TypeCheck(arg, tensor_type)) {
            DLTensor t;
            if (!dl_read(arg, &t) || (need_cuda && t.device.device_type != DL_CUDA)) return 0;
            PyObject *dtype = dl_arg(&t, &values[i], &codes[i]);
            if (dtype == NULL) return -1;
            dtypes[(*n_dtypes)++] = dtype;
        } else if (PyObject_TypeCheck(arg, tensor_type)) {
            if (need_cuda) {
                PyObject *on_cuda = PyObject_GetAttr(arg, is_cuda_name);
                if (on_cuda == NULL) return -1;
                Py_DECREF(on_cuda);
                if (on_cuda != Py_True) return 0;
            }
            PyObject *ptr = PyObject_CallMethodNoArgs(arg, data_ptr_name);
            if (ptr == NULL) return -1;
            values[i].u64 = PyLong_AsUnsignedLongLong(ptr);
            Py_DECREF(ptr);
            if (PyErr_Occurred()) return -1;
            PyObject *dtype = PyObject_GetAttr(arg, dtype_name);
            if (dtype == NULL) return -1;
            dtypes[(*n_dtypes)++] = dtype;
            codes[i] = TENSOR | ((values[i].u64 & 15) == 0 ? ALIGNED : 0);
        } else if (PyBool_Check(arg)) {
            values[i].u8 = arg == Py_True;
            codes[i] = BOOL;
        } else if (PyLong_CheckExact(arg)) {
            int overflow;
            long long v = PyLong_AsLongLongAndOverflow(arg, &overflow);
            if (overflow < 0) return 0;
            if (overflow > 0) {  /* from 2**63: Triton passes it as uint64 */
                unsigned long long u = PyLong_AsUnsignedLongLong(arg);
                if (PyErr_Occurred()) { PyErr_Clear(); return 0; }  /* past 2**64: Triton's error, on its path */
                values[i].u64 = u;
                codes[i] = INT | U64 | ((u & 15) == 0 ? DIV16 : 0);
            } else {
                if (v == -1 && PyErr_Occurred()) return -1;
                values[i].i64 = v;
                codes[i] = int_code(v);
            }
        } else if (PyFloat_CheckExact(arg)) {
            values[i].f32 = (float)PyFloat_AS_DOUBLE(arg);
            codes[i] = FLOAT;
        } else if (arg == Py_None) {
            values[i].u64 = 0;
            codes[i] = NONE;
        } else {
            return 0;
        }
    }
    return 1;
}

/* (prefix, codes, dtype, ...): steals the references in dtypes. */
static PyObject *make_key(PyObject *prefix, const char *codes, Py_ssize_t n, PyObject **dtypes, int n_dtypes) {
    PyObject *key = PyTuple_New(2 + n_dtypes);
    PyObject *code_bytes = PyBytes_FromStringAndSize(codes, n);
    if (key == NULL || code_bytes == NULL) {
        Py_XDECREF(key);
        Py_XDECREF(code_bytes);
        for (int i = 0; i < n_dtypes; i++) Py_DECREF(dtypes[i]);
        return NULL;
    }
    Py_INCREF(prefix);
    PyTuple_SET_ITEM(key, 0, prefix);
    PyTuple_SET_ITEM(key, 1, code_bytes);
    for (int i = 0; i < n_dtypes; i++) PyTuple_SET_ITEM(key, 2 + i, dtypes[i]);
    return key;
}

static PyObject *key(PyObject *self, PyObject *const *a, Py_ssize_t nargs) {
    if (nargs != 2 || !PyTuple_Check(a[1])) {
        PyErr_SetString(PyExc_TypeError, "key(prefix, args: tuple)");
        return NULL;
    }
    char codes[MAX_ARGS];
    Value values[MAX_ARGS];
    PyObject *dtypes[MAX_ARGS];
    int n_dtypes;
    int status = read_args(a[1], 0, codes, values, dtypes, &n_dtypes);
    if (status <= 0) {
        for (int i = 0; i < n_dtypes; i++) Py_DECREF(dtypes[i]);
        if (status < 0) return NULL;
        Py_RETURN_NONE;
    }
    return make_key(a[0], codes, PyTuple_GET_SIZE(a[1]), dtypes, n_dtypes);
}

/* Launches the entry kept under k (a new reference, released here) with the arguments' codes and values on
   `stream`: True, False when none is kept, NULL on an error. */
static PyObject *launch_kept(PyObject *kept, PyObject *k, PyObject *grid, unsigned long long stream,
                             const char *codes, Value *values, Py_ssize_t n) {
    if (k == NULL) return NULL;
    PyObject *entry = PyDict_GetItemWithError(kept, k);  /* borrowed */
    Py_DECREF(k);
    if (entry == NULL) {
        if (PyErr_Occurred()) return NULL;
        Py_RETURN_FALSE;
    }

    unsigned long long function;
    unsigned threads, shared, n_nulls;
    const char *kinds;
    Py_ssize_t n_kinds;
    PyObject *kernel;  /* held by the entry so that Triton keeps the function loaded; not used here */
    if (!PyArg_ParseTuple(entry, "KIIy#IO", &function, &threads, &shared, &kinds, &n_kinds, &n_nulls, &kernel))
        return NULL;
    if (n_kinds != n || n_nulls > MAX_NULLS) {
        PyErr_SetString(PyExc_ValueError, "a kept Triton kernel's entry does not match its arguments");
        return NULL;
    }
    unsigned dims[3] = {1, 1, 1};
    Py_ssize_t n_dims = PyTuple_GET_SIZE(grid);
    if (n_dims < 1 || n_dims > 3) {
        PyErr_SetString(PyExc_ValueError, "a grid has 1 to 3 dimensions");
        return NULL;
    }
    for (Py_ssize_t d = 0; d < n_dims; d++) {
        long long size = PyLong_AsLongLong(PyTuple_GET_ITEM(grid, d));
        if (size == -1 && PyErr_Occurred()) return NULL;
        if (size < 0 || size > 0x7fffffffLL) {
            PyErr_Format(PyExc_ValueError, "grid dimension %lld is out of range", size);
            return NULL;
        }
        dims[d] = (unsigned)size;
    }
    if (dims[0] == 0 || dims[1] == 0 || dims[2] == 0) Py_RETURN_TRUE;  /* Triton launches nothing either */

    void *params[MAX_ARGS + MAX_NULLS];
    uint64_t nulls[MAX_NULLS] = {0};
    int n_params = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        switch (kinds[i]) {
            case 'p': case 'l': case 'K': case 'i': case 'f': case 'b':
                params[n_params++] = &values[i];  /* the union's members share its first bytes (little-endian) */
                break;
            case '-':
                break;
            default:
                PyErr_Format(PyExc_ValueError, "unknown argument kind '%c' in a kept Triton kernel", kinds[i]);
                return NULL;
        }
        if (kinds[i] == 'i' && codes[i] & INT) values[i].i32 = (int32_t)values[i].i64;
    }
    for (unsigned i = 0; i < n_nulls; i++) params[n_params++] = &nulls[i];

    CUresult result;
    Py_BEGIN_ALLOW_THREADS;
    result = cu_launch((CUfunction)(uintptr_t)function, dims[0], dims[1], dims[2], threads, 1, 1, shared,
                       (CUstream)(uintptr_t)stream, params, NULL);
    Py_END_ALLOW_THREADS;
    if (result != 0) {
        const char *message = NULL;
        cu_error_string(result, &message);
        PyErr_Format(PyExc_RuntimeError, "launching a Triton kernel failed: CUDA error %d (%s)", result,
                     message ? message : "unknown");
        return NULL;
    }
    Py_RETURN_TRUE;
}

static PyObject *launch(PyObject *self, PyObject *const *a, Py_ssize_t nargs) {
    if (nargs != 5 || !PyDict_Check(a[0]) || !PyTuple_Check(a[2]) || !PyTuple_Check(a[4])) {
        PyErr_SetString(PyExc_TypeError, "launch(kept: dict, prefix, grid: tuple, stream: int, args: tuple)");
        return NULL;
    }
    PyObject *args = a[4];
    if (!open_driver()) Py_RETURN_FALSE;
    CUcontext context = NULL;
    if (cu_ctx_current(&context) != 0 || context == NULL) Py_RETURN_FALSE;

    char codes[MAX_ARGS];
    Value values[MAX_ARGS];
    PyObject *dtypes[MAX_ARGS];
    int n_dtypes;
    Py_ssize_t n = PyTuple_GET_SIZE(args);
    int status = read_args(args, 1, codes, values, dtypes, &n_dtypes);
    if (status <= 0) {
        for (int i = 0; i < n_dtypes; i++) Py_DECREF(dtypes[i]);
        if (status < 0) return NULL;
        Py_RETURN_FALSE;
    }
    unsigned long long stream = PyLong_AsUnsignedLongLong(a[3]);
    if (PyErr_Occurred()) {
        for (int i = 0; i < n_dtypes; i++) Py_DECREF(dtypes[i]);
        return NULL;
    }
    return launch_kept(a[0], make_key(a[1], codes, n, dtypes, n_dtypes), a[2], stream, codes, values, n);
}

/* --- norm(): the rmsnorm kernel's launch from its tensors ------------------------------------------------------ */

/* t read as rows of `width` contiguous elements, as torch's t.view(-1, width) reads it: the number of rows and the
   elements from one row to the next. 0 where that view would fail or copy, or the last dim is not `width`. */
static int as_rows(const DLTensor *t, int64_t width, int64_t *rows, int64_t *row_stride) {
    int nd = t->ndim;
    if (nd < 1 || t->shape[nd - 1] != width) return 0;
    if (t->strides == NULL) {
        *rows = 1;
        for (int d = 0; d < nd - 1; d++) *rows *= t->shape[d];
        *row_stride = width;
        return 1;
    }
    if (t->strides[nd - 1] != 1) return 0;  /* even at width 1, as torch's view reports it to the Python path */
    if (nd == 2) {  /* as triton_kernels._as_rows takes a 2-d tensor: its own row stride, even for one row */
        *rows = t->shape[0];
        *row_stride = t->strides[0];
        return 1;
    }
    int64_t n = 1, stride = width, inner = -1;  /* inner: the innermost leading dim longer than 1 */
    for (int d = nd - 2; d >= 0; d--) {
        if (t->shape[d] == 1) continue;
        if (inner >= 0 && t->strides[d] != t->strides[inner] * t->shape[inner]) return 0;
        if (inner < 0) stride = t->strides[d];
        inner = d;
        n *= t->shape[d];
    }
    for (int d = 0; d < nd - 1; d++) if (t->shape[d] == 0) n = 0;
    *rows = n;
    *row_stride = stride;
    return 1;
}

static int same_shape(const DLTensor *a, const DLTensor *b) {
    if (a->ndim != b->ndim) return 0;
    for (int d = 0; d < a->ndim; d++) if (a->shape[d] != b->shape[d]) return 0;
    return 1;
}

/* Reads a tensor argument through DLPack: 1 for a CUDA tensor on `device`, 0 (no exception set) for anything else. */
static int read_tensor(PyObject *obj, int device, DLTensor *t) {
    if (!PyObject_TypeCheck(obj, tensor_type) || !dl_read(obj, t)) return 0;
    /* a tensor without storage (a FakeTensor under tracing) has no address to launch on */
    return t->device.device_type == DL_CUDA && t->device.device_id == device && t->data != NULL;
}

/* The current CUDA device, where a context is current and tensors can be read through DLPack; -1 otherwise. */
static int current_device(void) {
    int device;
    if (dlpack == NULL || !open_driver() || cu_ctx_device(&device) != 0) return -1;
    return device;
}

/* Launches the kernel kept under (device, num_warps, constexprs) for runtime arguments that are `tensors`, then
   `ints`, then `eps` where not NULL (the order of the kernel's parameters, as the Python wrapper passes them):
   keyed as read_args keys the same arguments, on the device's current stream. */
static PyObject *launch_tensors(PyObject *kept, int device, PyObject *num_warps, PyObject *constexprs,
                                PyObject *grid, const DLTensor *const *tensors, int n_tensors, const int64_t *ints,
                                int n_ints, const double *eps) {
    char codes[MAX_ARGS];
    Value values[MAX_ARGS];
    PyObject *dtypes[MAX_ARGS];
    int n = 0;
    for (; n < n_tensors; n++) {
        dtypes[n] = dl_arg(tensors[n], &values[n], &codes[n]);
        if (dtypes[n] == NULL) {
            for (int j = 0; j < n; j++) Py_DECREF(dtypes[j]);
            return NULL;
        }
    }
    for (int i = 0; i < n_ints; i++, n++) {
        values[n].i64 = ints[i];
        codes[n] = int_code(ints[i]);
    }
    if (eps != NULL) {
        values[n].f32 = (float)*eps;
        codes[n++] = FLOAT;
    }
    void *stream = NULL;
    PyObject *prefix = Py_BuildValue("(iOO)", device, num_warps, constexprs);
    if (prefix == NULL || dlpack->current_work_stream(DL_CUDA, device, &stream) != 0) {
        Py_XDECREF(prefix);
        for (int j = 0; j < n_tensors; j++) Py_DECREF(dtypes[j]);
        return NULL;
    }
    PyObject *k = make_key(prefix, codes, n, dtypes, n_tensors);
    Py_DECREF(prefix);
    return launch_kept(kept, k, grid, (unsigned long long)(uintptr_t)stream, codes, values, n);
}

/* plans[key] (a new reference, so that a plans.clear() meanwhile cannot free it) where it is a tuple of `size`
   items; NULL with no exception where there is none yet. */
static PyObject *plan_for(PyObject *plans, PyObject *key, Py_ssize_t size) {
    if (key == NULL) return NULL;
    PyObject *plan = PyDict_GetItemWithError(plans, key);
    Py_DECREF(key);
    if (plan != NULL && (!PyTuple_Check(plan) || PyTuple_GET_SIZE(plan) != size)) {
        PyErr_Format(PyExc_ValueError, "a launch plan must be a tuple of %zd items", size);
        return NULL;
    }
    return Py_XNewRef(plan);
}

/* a / b rounded up, for a >= 0 and b > 0, without overflow whatever b (a plan's block is read from Python). */
static int64_t ceil_div(int64_t a, long long b) {
    return a / b + (a % b != 0);
}

/* Launches a plan (num_warps, constexprs, blocks a unit, ..., units a program) over `count` units (rope's tokens,
   act_and_mul's output elements): the grid (count over units a program, rounded up; blocks a unit), as
   launch_tensors launches; takes over the caller's reference to plan. False, having launched nothing, where the
   blocks or the units a program are not a positive int (NULL, with the exception, where they are not an int). */
static PyObject *launch_rows(PyObject *kept, int device, PyObject *plan, int64_t count,
                             const DLTensor *const *tensors, int n_tensors, const int64_t *ints, int n_ints) {
    long long blocks = PyLong_AsLongLong(PyTuple_GET_ITEM(plan, 2));
    long long per = blocks <= 0 ? 0 : PyLong_AsLongLong(PyTuple_GET_ITEM(plan, PyTuple_GET_SIZE(plan) - 1));
    PyObject *grid = per <= 0 ? NULL : Py_BuildValue("(LL)", (long long)ceil_div(count, per), blocks);
    PyObject *result = grid == NULL ? (PyErr_Occurred() ? NULL : Py_NewRef(Py_False))
                       : launch_tensors(kept, device, PyTuple_GET_ITEM(plan, 0), PyTuple_GET_ITEM(plan, 1), grid,
                                        tensors, n_tensors, ints, n_ints, NULL);
    Py_XDECREF(grid);
    Py_DECREF(plan);
    return result;
}

/* norm(kept, plans, x, residual, weight, out, eps); plans[(rows, width, element size, whether float16)] is
   (grid, num_warps and constexprs without the residual, num_warps and constexprs with it). */
static PyObject *norm(PyObject *self, PyObject *const *a, Py_ssize_t nargs) {
    if (nargs != 7 || !PyDict_Check(a[0]) || !PyDict_Check(a[1])) {
        PyErr_SetString(PyExc_TypeError, "norm(kept: dict, plans: dict, x, residual, weight, out, eps)");
        return NULL;
    }
    int fused = a[3] != Py_None, device = current_device();
    /* out is x without a residual: fused_add_rmsnorm called without one, which its Python path rejects */
    if (device < 0 || !PyFloat_Check(a[6]) || (!fused && a[5] == a[2])) Py_RETURN_FALSE;
    DLTensor x, res, w, out;
    if (!read_tensor(a[2], device, &x) || !read_tensor(a[4], device, &w) || !read_tensor(a[5], device, &out)
        || (fused && !read_tensor(a[3], device, &res)))
        Py_RETURN_FALSE;
    if (w.ndim != 1 || (w.strides != NULL && w.strides[0] != 1 && w.shape[0] > 1)) Py_RETURN_FALSE;
    int64_t width = w.shape[0], n_rows, x_stride, res_stride = 0, out_rows, out_stride;
    if (!as_rows(&x, width, &n_rows, &x_stride) || n_rows == 0 || !same_shape(&x, &out)
        || !as_rows(&out, width, &out_rows, &out_stride))
        Py_RETURN_FALSE;
    if (fused) {
        int64_t res_rows;
        if (!same_shape(&x, &res) || !as_rows(&res, width, &res_rows, &res_stride)) Py_RETURN_FALSE;
        if (n_rows > 1 && (x_stride < width || res_stride < width)) Py_RETURN_FALSE;  /* overlapping rows */
    }
    PyObject *plan = plan_for(a[1], Py_BuildValue("(LLiO)", (long long)n_rows, (long long)width,
                                                  (int)(x.dtype.bits / 8),
                                                  x.dtype.code == DL_FLOAT_CODE && x.dtype.bits == 16 ? Py_True
                                                                                                      : Py_False), 5);
    if (plan == NULL) return PyErr_Occurred() ? NULL : Py_NewRef(Py_False);  /* not planned yet */
    const DLTensor *tensors[4] = {&x, fused ? &res : &x, &w, &out};
    int64_t ints[5] = {n_rows, width, x_stride, res_stride, out_stride};
    double eps = PyFloat_AS_DOUBLE(a[6]);  /* a float or a subclass of it (numpy's float64), as float(eps) reads */
    PyObject *result = launch_tensors(a[0], device, PyTuple_GET_ITEM(plan, fused ? 3 : 1),
                                      PyTuple_GET_ITEM(plan, fused ? 4 : 2), PyTuple_GET_ITEM(plan, 0), tensors, 4,
                                      ints, 5, &eps);
    Py_DECREF(plan);
    return result;
}

/* act_and_mul(kept, plans, x, out, gelu); plans[(rows, d, gelu)] is (num_warps, constexprs, 1, elements a program):
   triton_kernels._act_plan, over the output's rows x d elements as one range. */
static PyObject *act_and_mul(PyObject *self, PyObject *const *a, Py_ssize_t nargs) {
    if (nargs != 5 || !PyDict_Check(a[0]) || !PyDict_Check(a[1]) || !PyBool_Check(a[4])) {
        PyErr_SetString(PyExc_TypeError, "act_and_mul(kept: dict, plans: dict, x, out, gelu: bool)");
        return NULL;
    }
    int device = current_device();
    if (device < 0) Py_RETURN_FALSE;
    DLTensor x, out;
    if (!read_tensor(a[2], device, &x) || !read_tensor(a[3], device, &out) || x.ndim < 1 || x.ndim != out.ndim)
        Py_RETURN_FALSE;
    int64_t width = x.shape[x.ndim - 1], d = width / 2, n_rows, x_stride, out_rows, out_stride;
    if (width % 2 || d == 0 || out.shape[out.ndim - 1] != d) Py_RETURN_FALSE;
    for (int i = 0; i < x.ndim - 1; i++) if (x.shape[i] != out.shape[i]) Py_RETURN_FALSE;
    if (!as_rows(&x, width, &n_rows, &x_stride) || n_rows == 0 || !as_rows(&out, d, &out_rows, &out_stride)
        || out_stride != d)
        Py_RETURN_FALSE;
    PyObject *plan = plan_for(a[1], Py_BuildValue("(LLO)", (long long)n_rows, (long long)d, a[4]), 4);
    if (plan == NULL) return PyErr_Occurred() ? NULL : Py_NewRef(Py_False);  /* not planned yet */
    const DLTensor *tensors[2] = {&x, &out};
    int64_t ints[2] = {n_rows * d, x_stride};
    return launch_rows(a[0], device, plan, n_rows * d, tensors, 2, ints, 2);
}

/* Whether t's dims from `first` on lie in one run of memory, row-major (a dim of size 1 whatever its stride), as
   torch's view reads them; their element count in *count. */
static int compact_from(const DLTensor *t, int first, int64_t *count) {
    int64_t expected = 1;
    for (int d = t->ndim - 1; d >= first; d--) {
        if (t->strides != NULL && t->strides[d] != expected && t->shape[d] > 1) return 0;
        expected *= t->shape[d];
    }
    *count = expected;
    return 1;
}

/* t as [n_tokens, width] rows with contiguous columns, as triton_kernels._token_rows views it; 0 if not so. */
static int token_rows(const DLTensor *t, int64_t n_tokens, int64_t *width, int64_t *row_stride) {
    if (t->ndim < 2 || t->shape[0] != n_tokens || t->strides == NULL || t->strides[t->ndim - 1] != 1
        || !compact_from(t, 1, width))
        return 0;
    *row_stride = t->strides[0];
    return 1;
}

/* rope(kept, plans, positions, query, key, head_size, cos_sin_cache, is_neox); plans[(head_size, rotary_dim,
   q heads, k heads, is_neox)] is (num_warps, constexprs, head blocks, query blocks, tokens a program):
   triton_kernels._rope_plan. */
static PyObject *rope(PyObject *self, PyObject *const *a, Py_ssize_t nargs) {
    if (nargs != 8 || !PyDict_Check(a[0]) || !PyDict_Check(a[1])) {
        PyErr_SetString(PyExc_TypeError, "rope(kept: dict, plans: dict, positions, query, key, head_size, "
                                         "cos_sin_cache, is_neox)");
        return NULL;
    }
    int device = current_device();
    if (device < 0 || !PyLong_CheckExact(a[5]) || !PyBool_Check(a[7])) Py_RETURN_FALSE;
    int overflow;
    long long head_size = PyLong_AsLongLongAndOverflow(a[5], &overflow);
    if (overflow || head_size <= 0) Py_RETURN_FALSE;  /* the Python path says what is wrong with it */
    DLTensor pos, q, k, cache;
    if (!read_tensor(a[2], device, &pos) || !read_tensor(a[3], device, &q) || !read_tensor(a[4], device, &k)
        || !read_tensor(a[6], device, &cache))
        Py_RETURN_FALSE;
    /* positions: int64 or int32 (DLPack's kDLInt is 0), one per token, in one run of memory */
    if (pos.dtype.code != 0 || (pos.dtype.bits != 64 && pos.dtype.bits != 32) || pos.dtype.lanes != 1) Py_RETURN_FALSE;
    int64_t n_tokens;
    if (!compact_from(&pos, 0, &n_tokens)) Py_RETURN_FALSE;
    if (cache.ndim != 2 || (cache.strides[1] != 1 && cache.shape[1] > 1)) Py_RETURN_FALSE;
    int64_t rotary_dim = cache.shape[1], q_width, k_width, q_stride, k_stride;
    if (rotary_dim % 2 || rotary_dim > head_size || n_tokens == 0) Py_RETURN_FALSE;
    if (!token_rows(&q, n_tokens, &q_width, &q_stride) || !token_rows(&k, n_tokens, &k_width, &k_stride)
        || q_width % head_size || k_width % head_size)
        Py_RETURN_FALSE;
    if (n_tokens > 1 && (q_stride < q_width || k_stride < k_width)) Py_RETURN_FALSE;  /* overlapping rows */
    int64_t q_heads = q_width / head_size, k_heads = k_width / head_size;
    PyObject *plan = plan_for(a[1], Py_BuildValue("(LLLLO)", head_size, (long long)rotary_dim, (long long)q_heads,
                                                  (long long)k_heads, a[7]), 5);
    if (plan == NULL) return PyErr_Occurred() ? NULL : Py_NewRef(Py_False);  /* not planned yet */
    long long q_blocks = PyLong_AsLongLong(PyTuple_GET_ITEM(plan, 3));
    if (q_blocks <= 0) {
        Py_DECREF(plan);
        return PyErr_Occurred() ? NULL : Py_NewRef(Py_False);
    }
    const DLTensor *tensors[4] = {&pos, &q, &k, &cache};
    int64_t ints[8] = {n_tokens, q_heads, k_heads, q_stride, k_stride, cache.strides[0], cache.shape[0], q_blocks};
    return launch_rows(a[0], device, plan, n_tokens, tensors, 4, ints, 8);
}

static PyObject *reads_dlpack(PyObject *self, PyObject *unused) {
    return PyBool_FromLong(dlpack != NULL);
}

static PyObject *param_sizes(PyObject *self, PyObject *function_obj) {
    unsigned long long function = PyLong_AsUnsignedLongLong(function_obj);
    if (PyErr_Occurred()) return NULL;
    if (!open_driver() || cu_param_info == NULL) Py_RETURN_NONE;
    PyObject *sizes = PyList_New(0);
    if (sizes == NULL) return NULL;
    for (size_t i = 0; i < MAX_ARGS + MAX_NULLS + 1; i++) {
        size_t offset, size;
        if (cu_param_info((CUfunction)(uintptr_t)function, i, &offset, &size) != 0) break;  /* past the last */
        PyObject *s = PyLong_FromSize_t(size);
        if (s == NULL || PyList_Append(sizes, s) < 0) {
            Py_XDECREF(s);
            Py_DECREF(sizes);
            return NULL;
        }
        Py_DECREF(s);
    }
    PyObject *result = PyList_AsTuple(sizes);
    Py_DECREF(sizes);
    return result;
}

static PyMethodDef methods[] = {
    {"key", (PyCFunction)(void (*)(void))key, METH_FASTCALL, "key(prefix, args) -> tuple or None"},
    {"launch", (PyCFunction)(void (*)(void))launch, METH_FASTCALL,
     "launch(kept, prefix, grid, stream, args) -> bool"},
    {"param_sizes", param_sizes, METH_O, "param_sizes(function) -> tuple of int, or None"},
    {"reads_dlpack", reads_dlpack, METH_NOARGS, "reads_dlpack() -> bool"},
    {"norm", (PyCFunction)(void (*)(void))norm, METH_FASTCALL,
     "norm(kept, plans, x, residual, weight, out, eps) -> bool"},
    {"act_and_mul", (PyCFunction)(void (*)(void))act_and_mul, METH_FASTCALL,
     "act_and_mul(kept, plans, x, out, gelu) -> bool"},
    {"rope", (PyCFunction)(void (*)(void))rope, METH_FASTCALL,
     "rope(kept, plans, positions, query, key, head_size, cos_sin_cache, is_neox) -> bool"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "autosel_triton_launch", NULL, -1, methods};

PyMODINIT_FUNC PyInit_autosel_triton_launch(void) {
    data_ptr_name = PyUnicode_InternFromString("data_ptr");
    dtype_name = PyUnicode_InternFromString("dtype");
    is_cuda_name = PyUnicode_InternFromString("is_cuda");
    PyObject *torch = PyImport_ImportModule("torch");
    if (torch == NULL || data_ptr_name == NULL || dtype_name == NULL || is_cuda_name == NULL) return NULL;
    tensor_type = (PyTypeObject *)PyObject_GetAttrString(torch, "Tensor");
    Py_DECREF(torch);
    if (tensor_type == NULL) return NULL;
    /* torch's DLPack C exchange API, where this torch has one of DLPack's major version 1. */
    PyObject *capsule = PyObject_GetAttrString((PyObject *)tensor_type, "__dlpack_c_exchange_api__");
    if (capsule != NULL && PyCapsule_IsValid(capsule, "dlpack_exchange_api")) {
        const DLPackExchangeAPI *api = PyCapsule_GetPointer(capsule, "dlpack_exchange_api");
        if (api != NULL && api->header.version.major == 1 && api->dltensor_from_py_object_no_sync != NULL
            && api->current_work_stream != NULL)
            dlpack = api;  /* a static table of torch's, alive as long as the process */
    }
    Py_XDECREF(capsule);
    PyErr_Clear();
    return PyModule_Create(&module);
}
