/* The direct launch of a kept Triton kernel: its key and its launch in one C call (autosel/ops/triton_launch.py).

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

typedef union {
    uint64_t u64;
    int64_t i64;
    int32_t i32;
    uint8_t u8;
    float f32;
} Value;

static int open_driver(void) {
    if (cu_launch != NULL) return 1;
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL) return 0;
    cu_ctx_current = (ctx_current_t)dlsym(lib, "cuCtxGetCurrent");
    cu_error_string = (error_string_t)dlsym(lib, "cuGetErrorString");
    cu_param_info = (param_info_t)dlsym(lib, "cuFuncGetParamInfo");  /* CUDA 12.4 and later */
    launch_t launch = (launch_t)dlsym(lib, "cuLaunchKernel");
    if (cu_ctx_current == NULL || cu_error_string == NULL || launch == NULL) return 0;
    cu_launch = launch;
    return 1;
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
        if (PyObject_TypeCheck(arg, tensor_type)) {
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
                codes[i] = INT | (v == 1 ? ONE : 0) | ((v & 15) == 0 ? DIV16 : 0)
                           | (v >= -2147483648LL && v < 2147483648LL ? I32 : 0);
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

static PyObject *launch(PyObject *self, PyObject *const *a, Py_ssize_t nargs) {
    if (nargs != 5 || !PyDict_Check(a[0]) || !PyTuple_Check(a[2]) || !PyTuple_Check(a[4])) {
        PyErr_SetString(PyExc_TypeError, "launch(kept: dict, prefix, grid: tuple, stream: int, args: tuple)");
        return NULL;
    }
    PyObject *kept = a[0], *prefix = a[1], *grid = a[2], *args = a[4];
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
    PyObject *k = make_key(prefix, codes, n, dtypes, n_dtypes);
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
    unsigned long long stream = PyLong_AsUnsignedLongLong(a[3]);
    if (PyErr_Occurred()) return NULL;
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
    return PyModule_Create(&module);
}
