"""A prepared call's repeated work in one C function: the direct call of a kept product.

A prepared call (``prepared.prepared_call``) reads its operands' array addresses, allocates the output, chooses the
thread count and calls the kernel's packed entry point. In Python that is a few functions and a ctypes call; on a
call that finds the caches cold (a small product after other work, as in a GNN layer after its dense transform)
each function and each attribute read costs microseconds, and those decide a Cora-sized SpMM against torch's
(design notes, stop 36). ``scorch_direct_call`` below does the same steps with the Python C API: the same torch
methods are called (``data_ptr``, ``numel``, the allocation, ``bind.call_threads``), in the same order, with the
kernel run with the GIL released, as ctypes runs it.

It is built like any kernel (``runtime.load``: compiled once, cached on disk by a hash of its source, the
library's stamp verified) and then imported from that library as an extension module (``scorch_direct``): called
through ctypes (a ``PYFUNCTYPE``), the Cora call in the benchmark's rounds kept 5 of the 13-21 us a C call
saves. Where this interpreter's ``Python.h`` is not found, or the helper does not build or import, ``program``
returns None and the prepared call stays in Python (``SCORCH_DIRECT=0`` asks for that too).
"""
from __future__ import annotations

import ctypes
import functools
import importlib.machinery
import importlib.util
import os
import sysconfig
import threading
from typing import NamedTuple

import torch

from ..compiler import runtime

#: the most arguments a packed kernel may take here (the C side's buffer)
MAX_ARGS = 64

# (``_GLIBCXX_INCLUDE_NEXT_C_HEADERS``: ``Python.h``'s <math.h> and <stdlib.h> are the C library's, not
#  libstdc++'s wrappers around <cmath> and its special functions: the helper's build 0.87 -> 0.69 s, AMD Zen 3)
_SOURCE = r"""
#define _GLIBCXX_INCLUDE_NEXT_C_HEADERS
#include "@PYTHON_H@"
#include <cstdint>

typedef void (*scorch_packed_fn)(const int64_t*);
@DECLARATIONS@

static PyObject *scorch_k_data_ptr, *scorch_k_numel, *scorch_k_levels, *scorch_k_vals, *scorch_k_pos,
    *scorch_k_crd, *scorch_k_calls, *scorch_k_call_threads, *scorch_k_mean_length, *scorch_one;

static int scorch_names(void) {
  if (scorch_k_data_ptr) return 0;
  scorch_k_data_ptr = PyUnicode_InternFromString("data_ptr");
  scorch_k_numel = PyUnicode_InternFromString("numel");
  scorch_k_levels = PyUnicode_InternFromString("_levels");
  scorch_k_vals = PyUnicode_InternFromString("_vals");
  scorch_k_pos = PyUnicode_InternFromString("pos");
  scorch_k_crd = PyUnicode_InternFromString("crd");
  scorch_k_calls = PyUnicode_InternFromString("calls");
  scorch_k_call_threads = PyUnicode_InternFromString("call_threads");
  scorch_k_mean_length = PyUnicode_InternFromString("mean_length");
  scorch_one = PyLong_FromLong(1);
  return (scorch_k_data_ptr && scorch_k_numel && scorch_k_levels && scorch_k_vals && scorch_k_pos &&
          scorch_k_crd && scorch_k_calls && scorch_k_call_threads && scorch_k_mean_length && scorch_one) ? 0 : -1;
}

static int scorch_int(PyObject* o, int64_t* out) {  // (a Python int, or -1 with the exception set)
  *out = (int64_t)PyLong_AsLongLong(o);
  return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

static int scorch_address(PyObject* t, int64_t* out) {  // t.data_ptr()
  PyObject* r = PyObject_CallMethodNoArgs(t, scorch_k_data_ptr);
  if (!r) return -1;
  const int rc = scorch_int(r, out);
  Py_DECREF(r);
  return rc;
}

// The array ``what`` (0 pos, 1 crd, 2 values) of the SparseTensor ``x`` (level ``lvl``), a new reference; read
// from its __dict__, as the Python prepared call does.
static PyObject* scorch_array(PyObject* x, long lvl, long what) {
  PyObject* d = PyObject_GenericGetDict(x, NULL);
  if (!d) return NULL;
  PyObject* t = NULL;
  if (what == SCORCH_VALUES) {
    t = PyDict_GetItemWithError(d, scorch_k_vals);
    Py_XINCREF(t);
  } else {
    PyObject* levels = PyDict_GetItemWithError(d, scorch_k_levels);
    PyObject* level = levels ? PySequence_GetItem(levels, lvl) : NULL;
    if (level) {
      t = PyObject_GetAttr(level, what == SCORCH_POS ? scorch_k_pos : scorch_k_crd);
      Py_DECREF(level);
    }
  }
  Py_DECREF(d);
  if (!t && !PyErr_Occurred()) PyErr_SetString(PyExc_KeyError, "scorch: a sparse operand without its arrays");
  return t;
}

// Whether the output's position ``out`` and the thread positions ``thr`` (a tuple) all lie in [0, n).
static bool scorch_positions(PyObject* out, PyObject* thr, Py_ssize_t n) {
  const long o = PyLong_AsLong(out);
  if (o < 0 || o >= n || !PyTuple_Check(thr)) return false;
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(thr); ++i) {
    const long t = PyLong_AsLong(PyTuple_GET_ITEM(thr, i));
    if (t < 0 || t >= n) return false;
  }
  PyErr_Clear();
  return true;
}

static PyObject* scorch_direct_run(PyObject* prog, PyObject* ops);

// prog: a ``Program`` (its fields at the positions of the enum above); ops: a tuple (or list) of operands
extern "C" PyObject* scorch_direct_call(PyObject* prog, PyObject* ops_given, PyObject* scalars) {
  (void)scalars;
  if (scorch_names()) return NULL;
  if (!PyTuple_Check(prog) || PyTuple_GET_SIZE(prog) != SCORCH_PROGRAM_FIELDS ||
      !(PyTuple_Check(ops_given) || PyList_Check(ops_given))) {
    PyErr_SetString(PyExc_TypeError, "scorch: a direct call takes its program and a tuple of operands");
    return NULL;
  }
  PyObject* ops = PyTuple_Check(ops_given) ? (Py_INCREF(ops_given), ops_given) : PyList_AsTuple(ops_given);
  if (!ops) return NULL;
  PyObject* r = scorch_direct_run(prog, ops);
  Py_DECREF(ops);
  return r;
}

static PyObject* scorch_direct_run(PyObject* prog, PyObject* ops) {
  int64_t a[@MAX_ARGS@];
  PyObject* tmpl = PyTuple_GET_ITEM(prog, SCORCH_P_TEMPLATE);
  const Py_ssize_t n = PyTuple_GET_SIZE(tmpl);
  if (n > @MAX_ARGS@ || !scorch_positions(PyTuple_GET_ITEM(prog, SCORCH_P_OUT_POS), PyTuple_GET_ITEM(prog, SCORCH_P_THREAD_POS), n)) {
    PyErr_SetString(PyExc_IndexError, "scorch: a direct call's argument positions are out of range");
    return NULL;
  }
  for (Py_ssize_t i = 0; i < n; ++i)
    if (scorch_int(PyTuple_GET_ITEM(tmpl, i), &a[i])) return NULL;
  PyObject* dyn = PyTuple_GET_ITEM(prog, SCORCH_P_DYNAMIC);
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(dyn); ++i) {
    PyObject* e = PyTuple_GET_ITEM(dyn, i);
    const long pos = PyLong_AsLong(PyTuple_GET_ITEM(e, 0)), op = PyLong_AsLong(PyTuple_GET_ITEM(e, 1));
    const long lvl = PyLong_AsLong(PyTuple_GET_ITEM(e, 2)), what = PyLong_AsLong(PyTuple_GET_ITEM(e, 3));
    if (op < 0 || op >= PyTuple_GET_SIZE(ops) || pos < 0 || pos >= n) {
      PyErr_SetString(PyExc_IndexError, "scorch: a direct call's operand or argument out of range");
      return NULL;
    }
    PyObject* x = PyTuple_GET_ITEM(ops, op);
    if (what == SCORCH_MEAN) {  // a level's positions per parent (a row's expected trip count): mean_length(x, lvl)
      PyObject* level = PyLong_FromLong(lvl);
      PyObject* mean = level ? PyObject_CallMethodObjArgs(PyTuple_GET_ITEM(prog, SCORCH_P_MODULE), scorch_k_mean_length, x,
                                                          level, NULL) : NULL;
      Py_XDECREF(level);
      const int rc = mean ? scorch_int(mean, &a[pos]) : -1;
      Py_XDECREF(mean);
      if (rc) return NULL;
      continue;
    }
    PyObject* t = what == SCORCH_DENSE ? (Py_INCREF(x), x) : scorch_array(x, lvl, what);
    if (!t) return NULL;
    const int rc = scorch_address(t, &a[pos]);
    Py_DECREF(t);
    if (rc) return NULL;
  }
  PyObject* out = PyObject_Call(PyTuple_GET_ITEM(prog, SCORCH_P_ALLOC), PyTuple_GET_ITEM(prog, SCORCH_P_ALLOC_ARGS),
                                PyTuple_GET_ITEM(prog, SCORCH_P_ALLOC_KEYWORDS));
  if (!out) return NULL;
  if (scorch_address(out, &a[PyLong_AsLong(PyTuple_GET_ITEM(prog, SCORCH_P_OUT_POS))])) {
    Py_DECREF(out);
    return NULL;
  }
  PyObject* thr = PyTuple_GET_ITEM(prog, SCORCH_P_THREAD_POS);
  if (PyTuple_GET_SIZE(thr)) {  // threads = bind.call_threads(driver's stored values * vectors per entry)
    PyObject* vals = scorch_array(PyTuple_GET_ITEM(ops, PyLong_AsLong(PyTuple_GET_ITEM(prog, SCORCH_P_DRIVER))), 0,
                                  SCORCH_VALUES);
    PyObject* count = vals ? PyObject_CallMethodNoArgs(vals, scorch_k_numel) : NULL;
    Py_XDECREF(vals);
    int64_t entries = 0, per = 0, threads = 0;
    PyObject* chooser = count ? PyObject_GetAttr(PyTuple_GET_ITEM(prog, SCORCH_P_MODULE), scorch_k_call_threads) : NULL;
    PyObject* work = NULL;
    if (chooser && !scorch_int(count, &entries) && !scorch_int(PyTuple_GET_ITEM(prog, SCORCH_P_PER_ENTRY), &per))
      work = PyLong_FromLongLong((long long)(entries * per));
    PyObject* chosen = work ? PyObject_CallOneArg(chooser, work) : NULL;
    Py_XDECREF(count);
    Py_XDECREF(chooser);
    Py_XDECREF(work);
    const int rc = chosen ? scorch_int(chosen, &threads) : -1;
    Py_XDECREF(chosen);
    if (rc) {
      Py_DECREF(out);
      return NULL;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(thr); ++i) a[PyLong_AsLong(PyTuple_GET_ITEM(thr, i))] = threads;
  }
  int64_t address = 0;
  if (scorch_int(PyTuple_GET_ITEM(prog, SCORCH_P_ADDRESS), &address)) {
    Py_DECREF(out);
    return NULL;
  }
  const scorch_packed_fn kernel = (scorch_packed_fn)(intptr_t)address;
  Py_BEGIN_ALLOW_THREADS
  kernel(a);
  Py_END_ALLOW_THREADS
  PyObject* plan = PyTuple_GET_ITEM(prog, SCORCH_P_PLAN);  // plan.calls += 1
  PyObject* calls = PyObject_GetAttr(plan, scorch_k_calls);
  PyObject* more = calls ? PyNumber_Add(calls, scorch_one) : NULL;
  const int rc = more ? PyObject_SetAttr(plan, scorch_k_calls, more) : -1;
  Py_XDECREF(calls);
  Py_XDECREF(more);
  if (rc) {
    Py_DECREF(out);
    return NULL;
  }
  return out;
}

// --- the product operator: ``S @ X`` and ``X @ S`` in one C call where a kept call stands ---------------------
// ``SparseTensor.__matmul__`` / ``__rmatmul__`` once ``operators`` configured it: ``prepared.stands``, compiled,
// in the same order, then the kept call (its direct form where it has one); every other call goes to the Python
// operator (``fallback``), which tests again and takes the long way.

struct scorch_ref {  // an owned reference, released at the end of its scope
  PyObject* p;
  explicit scorch_ref(PyObject* o) : p(o) {}
  ~scorch_ref() { Py_XDECREF(p); }
  scorch_ref(const scorch_ref&) = delete;
  scorch_ref& operator=(const scorch_ref&) = delete;
};

enum { SCORCH_FAST_EQ, SCORCH_STRUCTURAL, SCORCH_BACKEND, SCORCH_DEFERRAL, SCORCH_TENSOR, SCORCH_STRIDED,
       SCORCH_COMPILER, SCORCH_IS_COMPILING, SCORCH_GRAD_ENABLED, SCORCH_AUTOCAST, SCORCH_FALLBACK, SCORCH_FIELDS,
       SCORCH_CONFIG };
// the positions of a kept product's fields (``prepared.KeptProduct``: configure reads them from its field names)
static Py_ssize_t scorch_kf_prepared = -1, scorch_kf_values_dtype, scorch_kf_format, scorch_kf_index_dtype,
    scorch_kf_generation, scorch_kf_structural, scorch_kf_size;
static PyObject* scorch_config = NULL;  // the tuple ``operators`` passes, in the order above
static long long scorch_counts[2];      // products the kept call served, products handed to the fallback
static PyObject *scorch_k_products, *scorch_k_format, *scorch_k_index_dtype, *scorch_k_generation, *scorch_k_on,
    *scorch_k_name, *scorch_k_value, *scorch_k_flag, *scorch_k_shape, *scorch_k_dtype, *scorch_k_is_cpu,
    *scorch_k_layout, *scorch_k_is_contiguous, *scorch_k_is_neg, *scorch_k_requires_grad, *scorch_k_run,
    *scorch_s_cpp, *scorch_s_all;

static int scorch_operator_names(void) {
  if (scorch_k_products) return 0;
  PyObject** slots[] = {&scorch_k_products, &scorch_k_format, &scorch_k_index_dtype, &scorch_k_generation,
                        &scorch_k_on, &scorch_k_name, &scorch_k_value, &scorch_k_flag, &scorch_k_shape,
                        &scorch_k_dtype, &scorch_k_is_cpu, &scorch_k_layout, &scorch_k_is_contiguous,
                        &scorch_k_is_neg, &scorch_k_requires_grad, &scorch_k_run, &scorch_s_cpp, &scorch_s_all};
  const char* text[] = {"_products", "_format", "_index_dtype", "generation", "on", "name", "value",
                        "_is_compiling_flag", "shape", "dtype", "is_cpu", "layout", "is_contiguous",
                        "is_neg", "requires_grad", "run", "cpp", "all"};
  for (size_t i = 0; i < sizeof(slots) / sizeof(slots[0]); ++i)
    if (!(*slots[i] = PyUnicode_InternFromString(text[i]))) return -1;
  return 0;
}

// getattr(o, name) against want: 1 where it is want (``is``; ``==`` where eq), 0 where not, -1 on an error
static int scorch_attr_is(PyObject* o, PyObject* name, PyObject* want, bool eq) {
  scorch_ref r(PyObject_GetAttr(o, name));
  if (!r.p) return -1;
  return eq ? PyObject_RichCompareBool(r.p, want, Py_EQ) : r.p == want;
}

#define SCORCH_CFG(i) PyTuple_GET_ITEM(cfg, i)

// Whether torch.compile traces (``torch.compiler.is_compiling()``: its flag, or the call where there is no flag)
static int scorch_compiling(PyObject* cfg) {
  scorch_ref flag(PyObject_GetAttr(SCORCH_CFG(SCORCH_COMPILER), scorch_k_flag));
  if (flag.p) return PyObject_IsTrue(flag.p);
  PyErr_Clear();
  scorch_ref r(PyObject_CallNoArgs(SCORCH_CFG(SCORCH_IS_COMPILING)));
  return r.p ? PyObject_IsTrue(r.p) : -1;
}

// The kept call of ``s @ other`` (left) or ``other @ s`` (a new reference), or NULL where
// ``prepared.kept_product`` gives none or the deferral mode is "all" (as ``ops.linalg._operator`` reads them)
static PyObject* scorch_kept(PyObject* cfg, PyObject* s, PyObject* other, bool left) {
  PyObject* tensor = SCORCH_CFG(SCORCH_TENSOR);
  if ((PyObject*)Py_TYPE(other) != tensor) return NULL;
  scorch_ref d(PyObject_GenericGetDict(s, NULL));
  PyObject* memo = d.p ? PyDict_GetItemWithError(d.p, scorch_k_products) : NULL;
  if (!memo || !PyDict_Check(memo)) return NULL;
  scorch_ref shape(PyObject_GetAttr(other, scorch_k_shape));
  scorch_ref dtype(shape.p ? PyObject_GetAttr(other, scorch_k_dtype) : NULL);
  scorch_ref key(dtype.p ? PyTuple_Pack(3, left ? Py_True : Py_False, shape.p, dtype.p) : NULL);
  PyObject* entry = key.p ? PyDict_GetItemWithError(memo, key.p) : NULL;
  if (!entry || !PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) != scorch_kf_size) return NULL;
  Py_INCREF(entry);  // (held: the reads below may run Python code, a thread-local's __init__ in a new thread)
  scorch_ref entry_held(entry);
  PyObject* v = PyDict_GetItemWithError(d.p, scorch_k_vals);
  Py_XINCREF(v);
  scorch_ref v_held(v);
  if (!v || (PyObject*)Py_TYPE(v) != tensor ||
      scorch_attr_is(v, scorch_k_dtype, PyTuple_GET_ITEM(entry, scorch_kf_values_dtype), false) != 1 ||
      PyDict_GetItemWithError(d.p, scorch_k_format) != PyTuple_GET_ITEM(entry, scorch_kf_format) ||
      PyDict_GetItemWithError(d.p, scorch_k_index_dtype) != PyTuple_GET_ITEM(entry, scorch_kf_index_dtype) ||
      scorch_attr_is(SCORCH_CFG(SCORCH_FAST_EQ), scorch_k_generation,
                     PyTuple_GET_ITEM(entry, scorch_kf_generation), true) != 1 ||
      scorch_attr_is(SCORCH_CFG(SCORCH_STRUCTURAL), scorch_k_on, PyTuple_GET_ITEM(entry, scorch_kf_structural),
                     true) != 1 ||
      scorch_attr_is(SCORCH_CFG(SCORCH_BACKEND), scorch_k_name, scorch_s_cpp, true) != 1 ||
      scorch_attr_is(other, scorch_k_is_cpu, Py_True, false) != 1 ||
      scorch_attr_is(other, scorch_k_layout, SCORCH_CFG(SCORCH_STRIDED), false) != 1)
    return NULL;
  {
    scorch_ref contiguous(PyObject_CallMethodNoArgs(other, scorch_k_is_contiguous));
    if (contiguous.p != Py_True) return NULL;
    scorch_ref negative(PyObject_CallMethodNoArgs(other, scorch_k_is_neg));  // (its storage has the other sign)
    if (negative.p != Py_False) return NULL;
  }
  int grad = scorch_attr_is(v, scorch_k_requires_grad, Py_True, false);
  if (grad == 0) grad = scorch_attr_is(other, scorch_k_requires_grad, Py_True, false);
  if (grad < 0) return NULL;
  if (grad) {
    scorch_ref on(PyObject_CallNoArgs(SCORCH_CFG(SCORCH_GRAD_ENABLED)));
    if (on.p != Py_False) return NULL;
  }
  {
    scorch_ref autocast(PyObject_CallNoArgs(SCORCH_CFG(SCORCH_AUTOCAST)));  // (its product casts the operands)
    if (autocast.p != Py_False) return NULL;
  }
  PyObject* fast = PyTuple_GET_ITEM(entry, scorch_kf_prepared);
  if (fast == Py_None || fast == Py_False ||
      scorch_attr_is(SCORCH_CFG(SCORCH_DEFERRAL), scorch_k_value, scorch_s_all, true) != 0)
    return NULL;
  return PyObject_GetAttr(fast, scorch_k_run);  // (``Prepared.run``: its C form, once its first call made one)
}

static PyObject* scorch_product(PyObject* const* argv, Py_ssize_t argc, bool left) {
  if (argc != 2) {
    PyErr_SetString(PyExc_TypeError, "scorch: a product operator takes the SparseTensor and one other operand");
    return NULL;
  }
  if (!scorch_config) {
    PyErr_SetString(PyExc_RuntimeError, "scorch: the product operator is not configured");
    return NULL;
  }
  PyObject *s = argv[0], *other = argv[1];
  PyObject* cfg = scorch_config;  // (held for the call: a ``configure`` meanwhile replaces it, not under us)
  Py_INCREF(cfg);
  scorch_ref held(cfg);
  if (scorch_compiling(cfg) == 0) {
    scorch_ref fn(scorch_kept(cfg, s, other, left));
    if (fn.p) {
      scorch_ref ops(left ? PyTuple_Pack(2, s, other) : PyTuple_Pack(2, other, s));
      if (!ops.p) return NULL;
      PyObject* args[2] = {ops.p, Py_None};
      PyObject* r = PyObject_Vectorcall(fn.p, args, 2, NULL);
      // (a RuntimeError before the kernel ran, such as a torch.func transform's tensor without storage: the
      // Python operator, which refuses the kept call there, takes the long way or raises it again)
      if (r || !PyErr_ExceptionMatches(PyExc_RuntimeError)) {
        ++scorch_counts[0];
        return r;
      }
    }
  }
  PyErr_Clear();  // (a read that failed above fails again, and raises, on the Python operator's way)
  ++scorch_counts[1];
  PyObject* args[3] = {s, other, left ? Py_True : Py_False};
  return PyObject_Vectorcall(SCORCH_CFG(SCORCH_FALLBACK), args, 3, NULL);
}

static PyObject* scorch_matmul(PyObject* self, PyObject* const* argv, Py_ssize_t argc) {
  (void)self;
  return scorch_product(argv, argc, true);
}

static PyObject* scorch_rmatmul(PyObject* self, PyObject* const* argv, Py_ssize_t argc) {
  (void)self;
  return scorch_product(argv, argc, false);
}

static PyObject* scorch_configure(PyObject* self, PyObject* config) {
  (void)self;
  if (!PyTuple_Check(config) || PyTuple_GET_SIZE(config) != SCORCH_CONFIG) {
    PyErr_SetString(PyExc_TypeError, "scorch: the product operator's configuration is a tuple of its 12 parts");
    return NULL;
  }
  if (scorch_names() || scorch_operator_names()) return NULL;
  PyObject* fields = PyTuple_GET_ITEM(config, SCORCH_FIELDS);  // (KeptProduct's positions, then its length)
  Py_ssize_t* slots[] = {&scorch_kf_prepared, &scorch_kf_values_dtype, &scorch_kf_format, &scorch_kf_index_dtype,
                         &scorch_kf_generation, &scorch_kf_structural, &scorch_kf_size};
  const Py_ssize_t count = sizeof(slots) / sizeof(slots[0]);
  if (!PyTuple_Check(fields) || PyTuple_GET_SIZE(fields) != count) {
    PyErr_SetString(PyExc_TypeError, "scorch: the kept product's field positions are a tuple of 7 numbers");
    return NULL;
  }
  for (Py_ssize_t i = 0; i < count; ++i) {
    const Py_ssize_t v = PyLong_AsSsize_t(PyTuple_GET_ITEM(fields, i));
    if (v < 0 || (i < count - 1 && v >= PyLong_AsSsize_t(PyTuple_GET_ITEM(fields, count - 1)))) {
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "scorch: a kept product's field out of range");
      return NULL;
    }
    *slots[i] = v;
  }
  Py_INCREF(config);
  Py_XSETREF(scorch_config, config);
  Py_RETURN_NONE;
}

static PyObject* scorch_method(PyObject* self, PyObject* fn) {  // fn bound as a method (``instancemethod``)
  (void)self;
  return PyInstanceMethod_New(fn);
}

static PyObject* scorch_operator_counts(PyObject* self, PyObject* unused) {
  (void)self;
  (void)unused;
  return Py_BuildValue("(LL)", scorch_counts[0], scorch_counts[1]);
}

static PyObject* scorch_direct_fastcall(PyObject* self, PyObject* const* argv, Py_ssize_t argc) {
  (void)self;
  if (argc != 3) {
    PyErr_SetString(PyExc_TypeError, "scorch: a direct call takes (program, operands, scalars)");
    return NULL;
  }
  return scorch_direct_call(argv[0], argv[1], argv[2]);
}

static PyMethodDef scorch_direct_methods[] = {
    {"call", (PyCFunction)(void (*)(void))scorch_direct_fastcall, METH_FASTCALL, "a prepared call's direct form"},
    {"matmul", (PyCFunction)(void (*)(void))scorch_matmul, METH_FASTCALL, "S @ X (SparseTensor.__matmul__)"},
    {"rmatmul", (PyCFunction)(void (*)(void))scorch_rmatmul, METH_FASTCALL, "X @ S (SparseTensor.__rmatmul__)"},
    {"configure", scorch_configure, METH_O, "the product operator's configuration"},
    {"method", scorch_method, METH_O, "a callable bound as a method"},
    {"counts", scorch_operator_counts, METH_NOARGS, "(kept calls served, calls handed to the fallback)"},
    {NULL, NULL, 0, NULL}};
static struct PyModuleDef scorch_direct_module = {PyModuleDef_HEAD_INIT, "scorch_direct", NULL, -1,
                                                  scorch_direct_methods};
extern "C" PyObject* PyInit_scorch_direct(void) { return PyModule_Create(&scorch_direct_module); }
"""

#: what a per-call argument of a prepared call reads from its operand: a level's ``pos`` or ``crd`` array, the
#: stored values, a dense operand itself, or a level's positions per parent (``args.mean_length``)
POS, CRD, VALUES, DENSE, MEAN = range(5)


class Program(NamedTuple):
    """A direct call's program: what ``scorch_direct_call`` reads, by the positions of these fields (the C source
    is given them as an enum: ``_declarations``)."""
    address: int           # the kernel's packed entry point
    template: tuple        # every argument known from the signature; 0 where read per call
    dynamic: tuple         # per-call arguments: (argument position, operand, level, what: POS ... MEAN)
    out_pos: int           # the output array's argument position
    thread_pos: tuple      # the thread count's argument positions
    per_entry: int         # vectors of work per stored value of the driver (``call_threads``' work)
    driver: int            # the operand whose stored values count the work
    alloc: object          # the output's allocation, called as alloc(*alloc_args, **alloc_keywords)
    alloc_args: tuple
    alloc_keywords: dict
    module: object         # the module with ``call_threads`` and ``mean_length`` (``engine.bind``)
    plan: object           # the plan (its ``calls`` counted)

    def __repr__(self):
        return f"Program(kernel at {self.address:#x}, {len(self.template)} arguments, {len(self.dynamic)} read per call)"


def _declarations() -> str:
    """The C enums of ``Program``'s fields and of what a per-call argument reads, from their Python names."""
    fields = ", ".join(f"SCORCH_P_{name.upper()}" for name in Program._fields)
    return (f"enum {{ {fields}, SCORCH_PROGRAM_FIELDS }};\n"
            f"enum {{ SCORCH_POS = {POS}, SCORCH_CRD = {CRD}, SCORCH_VALUES = {VALUES}, SCORCH_DENSE = {DENSE},"
            f" SCORCH_MEAN = {MEAN} }};")


_lock = threading.Lock()
_loaded: list = []  # [the extension module, or None where it cannot be had]: decided once a process
_building: list = []  # [the thread that builds the helper] while it does
_on_ready: list = []  # what to run once the helper is decided (``when_ready``)


def _python_h() -> str | None:
    include = sysconfig.get_paths().get("include")
    path = os.path.join(include, "Python.h") if include else None
    return path if path and os.path.isfile(path) and '"' not in path and "\n" not in path else None


def _source() -> str | None:
    """The helper's C++ source, or None where this interpreter's ``Python.h`` is missing or ``SCORCH_DIRECT=0``."""
    header = _python_h()
    if header is None or os.environ.get("SCORCH_DIRECT", "1") == "0":
        return None
    return _SOURCE.replace("@PYTHON_H@", header).replace("@MAX_ARGS@", str(MAX_ARGS)) \
        .replace("@DECLARATIONS@", _declarations())


def _imported(source: str, build: bool):
    """The helper imported from its library (built where ``build``), None where it is not on disk and not to be
    built, False where it does not build or import."""
    try:
        kernel = runtime.load(source, "PyInit_scorch_direct", [], ctypes.c_void_p, build=build)
        if kernel is None:
            return None
        loader = importlib.machinery.ExtensionFileLoader("scorch_direct", str(kernel.path))
        module = importlib.util.module_from_spec(importlib.util.spec_from_loader("scorch_direct", loader))
        loader.exec_module(module)
        return module
    except (runtime.CompileError, OSError, ImportError):
        return False


def _decided(module) -> None:
    """Record the helper (or None), then run what waited for it (``when_ready``); one that fails leaves its
    Python path in place."""
    with _lock:
        _loaded.append(module or None)
        _building.clear()
        waiting = list(_on_ready)
        _on_ready.clear()
    for fn in waiting:
        try:
            fn()
        except Exception:  # (the Python path it would have replaced serves)
            pass


def _build(source: str) -> None:
    module = False
    try:
        module = _imported(source, True)
    except Exception:  # (no compiler, say: a kernel's own build reports it; the Python path serves)
        pass
    finally:
        _decided(module)


def _module(wait: bool = False):
    """The extension module ``scorch_direct``, or None where this interpreter's headers are missing, the helper
    does not build or import, or ``SCORCH_DIRECT=0`` (read once, at the first use): none of these is an error,
    the Python path serves. A helper on disk is loaded at once; one to compile (~0.4 s of g++, once a cache) is
    built by a thread in the background and None returned until it is there, so that a process's first product
    does not wait for it (``wait``: wait for it)."""
    if _loaded:
        return _loaded[0]
    start = None
    with _lock:
        if not _loaded and not _building:
            source = _source()
            module = _imported(source, False) if source is not None else False
            if module is not None:
                _loaded.append(module or None)
            else:
                start = threading.Thread(target=_build, args=(source,), name="scorch-direct-build")
                _building.append(start)
        building = _building[0] if _building else None
    if start is not None:
        start.start()
    if wait and building is not None:
        building.join()
    return _loaded[0] if _loaded else None


def when_ready(fn) -> None:
    """Run ``fn()`` once the helper is decided (``_module``): now where it is, else from the thread that builds
    it, when that ends (so a prepared call made while it builds gets its C form then)."""
    _module()
    with _lock:
        if not _loaded:
            _on_ready.append(fn)
            return
    fn()


def wait():
    """The helper, waiting for its build where one runs (tests, benchmarks that measure the C path)."""
    return _module(wait=True)


def _forked() -> None:
    """In a fork's child: the parent's build thread is not there (nor its release of ``_lock``; the runtime gives
    the child fresh locks of its own, ``runtime._forked``). A child forked while the helper built takes the Python
    path rather than build the helper again (a DataLoader's workers would each run g++)."""
    global _lock
    _lock = threading.Lock()
    if _building and not _loaded:
        _building.clear()
        _on_ready.clear()
        _loaded.append(None)


os.register_at_fork(after_in_child=_forked)


def function(wait: bool = False):
    """``scorch_direct_call`` as a callable ``(prog, ops, scalars) -> tensor``, or None where there is no helper
    (``_module``; ``wait``: for its build)."""
    module = _module(wait)
    return None if module is None else module.call


def operators(fallback, fast_eq, structural, backend, deferral, fields):
    """``(__matmul__, __rmatmul__)`` for SparseTensor written in C, or None where there is no helper: each takes
    the product's kept call where ``prepared.kept_product`` would give it (``prepared.stands``, compiled: the kept
    entry on the tensor, ``fast_eq``'s generation, ``structural.on``, ``backend.name``, the dense operand's type,
    device, layout, contiguity, negative bit and gradient, the grad mode, autocast) and ``deferral.value`` is not
    "all", and torch.compile does not trace; otherwise it calls ``fallback(s, other, left)``, the Python operator.
    ``fields``: the position of each field of a kept entry (``prepared.KeptProduct``) by name. A cold ``S @ X``
    then enters no Python function. ``operator_counts`` counts both ways."""
    module = _module()
    if module is None:
        return None
    read = ("prepared", "values_dtype", "format", "index_dtype", "generation", "structural")
    module.configure((fast_eq, structural, backend, deferral, torch.Tensor, torch.strided, torch.compiler,
                      torch.compiler.is_compiling, torch.is_grad_enabled, torch._C._is_any_autocast_enabled,
                      fallback, tuple(fields[name] for name in read) + (len(fields),)))
    return module.method(module.matmul), module.method(module.rmatmul)


def operator_counts() -> tuple[int, int] | None:
    """``(products the kept call served, products handed to the Python operator)`` by the C operators since the
    process started, or None where there is no helper."""
    module = _module()
    return None if module is None else module.counts()


def program(plan, template, dynamic, out_pos, thr_pos, per_entry, driver, alloc, alloc_args, dtype, module):
    """The direct call of a prepared call whose every argument but the operands' addresses, the output's and the
    thread count is known (``template``): a callable ``(ops, scalars) -> output`` (a ``Program`` bound to
    ``scorch_direct_call``), or None where there is no direct call (no helper, no packed kernel, too many
    arguments)."""
    fn = function()
    packed = getattr(plan.kernel, "packed", None)
    given = {d[0] for d in dynamic} | {out_pos, *thr_pos}
    if fn is None or packed is None or len(template) > MAX_ARGS or any(
            not isinstance(v, int) for n, v in enumerate(template) if n not in given):
        return None
    address = ctypes.cast(packed, ctypes.c_void_p).value
    prog = Program(address, tuple(0 if v is None else int(v) for v in template), tuple(tuple(d) for d in dynamic),
                   out_pos, tuple(thr_pos), per_entry, driver, alloc, tuple(alloc_args), {"dtype": dtype}, module, plan)
    return functools.partial(fn, prog)
