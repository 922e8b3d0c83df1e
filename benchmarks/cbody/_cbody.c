/* _cbody: hmp's wrapper body (hmp/core/wrap.py, _body) in C, a prototype for
   issue 33. CPython API only, no libtorch. Built twice from this file by
   build.py: _cbody (Py_LIMITED_API 3.9, one abi3 binary) and _cbody_full
   (the version-specific API: PyObject_CallOneArg, PyMethod_New, macros).

   Wrapper(op, prepare, src, cast, refuse, inplace_at, hidden, needs, state,
   wrapped=None) runs the fast paths of the Python body; everything else is
   Python, handed in once through setup(): the promote rule's prepare, the
   refuse-with-decay scan (policy.cast_seq), write-back (after), rescue. */
#ifndef MODULE_ID /* build.py names the two builds */
#define MODULE_ID _cbody
#endif
#define STR_(n) #n
#define STR(n) STR_(n)
#define MODULE_NAME STR(MODULE_ID)
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#ifdef Py_LIMITED_API
#define CALL1(f, a) PyObject_CallFunctionObjArgs((f), (a), NULL)
#else
#define CALL1(f, a) PyObject_CallOneArg((f), (a))
#endif

/* Per process, from setup(): torch's types, hmp's constants and hooks. */
static struct {
    PyTypeObject *tensor, *parameter;
    PyObject *floats[4];     /* policy.FLOATS: the promote rule's dtypes */
    PyObject *promote;       /* wrap.PROMOTE */
    PyObject *off, *zero;    /* state.OFF, 0 */
    PyObject *cast_seq;      /* policy.cast_seq: scans with refuse.decay */
    PyObject *is_number;     /* policy._is_number(type) */
    PyObject *after;         /* after(a, args, k, kwargs): write-back */
    PyObject *rescue;        /* rescue(exc, op, wrapped, args, kwargs, a, k) */
    PyObject *raise;         /* fallback.RAISE */
    PyObject *method_type;   /* types.MethodType (limited API has no PyMethod_New) */
    PyObject *s_off, *s_dtype, *s_decay;
    int ready;
} G;

typedef struct {
    PyObject_HEAD
    PyObject *op, *prepare, *wrapped, *src, *cast, *refuse, *needs, *state;
    Py_ssize_t inplace_at;
    int hidden, decay, promote, nsrc;
    PyObject *srcs[4]; /* src's dtypes (src holds them), compared by identity */
    PyObject *dict, *weaklist;
} Wrapper;

/* isinstance(x, torch.Tensor), without a call for the usual non-tensors */
static int is_tensor(PyObject *x)
{
    PyTypeObject *t = Py_TYPE(x);
    if (t == G.tensor || t == G.parameter || PyType_IsSubtype(t, G.tensor))
        return 1;
    if (x == Py_None || t == &PyLong_Type || t == &PyFloat_Type || t == &PyBool_Type ||
        t == &PyList_Type || t == &PyTuple_Type || t == &PyUnicode_Type)
        return 0;
    return PyObject_IsInstance(x, (PyObject *)G.tensor);
}

/* x.dtype, borrowed: torch keeps its dtype objects alive */
static PyObject *dtype_of(PyObject *x)
{
    PyObject *d = PyObject_GetAttr(x, G.s_dtype);
    if (d)
        Py_DECREF(d);
    return d;
}

/* a tuple's or list's size and items (borrowed); a list's size is read again
   each step, since a cast (Python) may change the list */
#ifdef Py_LIMITED_API
#define seq_size(s) (PyTuple_Check(s) ? PyTuple_Size(s) : PyList_Size(s))
#define seq_item(s, i) (PyTuple_Check(s) ? PyTuple_GetItem(s, i) : PyList_GetItem(s, i))
#else
#define seq_size(s) (PyTuple_Check(s) ? PyTuple_GET_SIZE(s) : PyList_GET_SIZE(s))
#define seq_item(s, i) (PyTuple_Check(s) ? PyTuple_GET_ITEM(s, i) : PyList_GET_ITEM(s, i))
#endif

/* policy.cast_seq's refuse check of a non-tensor item: 1 refuse, 0 fine, -1 error */
static int refused(Wrapper *w, PyObject *x)
{
    PyObject *num = x, *r;
    int v;
    if (!PyFloat_CheckExact(x) && !PyLong_CheckExact(x)) {
        if (x == Py_None || PyBool_Check(x) || PyUnicode_CheckExact(x))
            return 0;
        r = CALL1(G.is_number, (PyObject *)Py_TYPE(x));
        if (!r)
            return -1;
        v = PyObject_IsTrue(r);
        Py_DECREF(r);
        if (v <= 0)
            return v;
        if (!(num = PyNumber_Float(x)))
            return -1;
    } else {
        Py_INCREF(num);
    }
    r = CALL1(w->refuse, num);
    Py_DECREF(num);
    if (!r)
        return -1;
    v = PyObject_IsTrue(r);
    Py_DECREF(r);
    return v;
}

/* policy.cast_seq without refuse.decay: a new reference to seq when nothing
   was cast, a new tuple/list when something was, Py_None when refuse says
   no, NULL on error. */
static PyObject *scan(Wrapper *w, PyObject *seq)
{
    PyObject *out = NULL, *x, *c;
    int tuple = PyTuple_Check(seq);
    for (Py_ssize_t i = 0; i < seq_size(seq); i++) {
        if (!(x = seq_item(seq, i)))
            goto fail;
        Py_INCREF(x);
        c = NULL;
        int t = is_tensor(x);
        if (t < 0)
            goto fail_x;
        if (t) {
            PyObject *d = dtype_of(x);
            if (!d)
                goto fail_x;
            int hit = 0;
            for (int k = 0; k < w->nsrc; k++)
                hit |= d == w->srcs[k];
            if (hit && !(c = CALL1(w->cast, x))) {
                /* a subclass that refuses the cast stays uncast */
                if (Py_TYPE(x) == G.tensor || Py_TYPE(x) == G.parameter ||
                    !PyErr_ExceptionMatches(PyExc_Exception))
                    goto fail_x;
                PyErr_Clear();
            }
        } else if (PyList_CheckExact(x) || PyTuple_CheckExact(x)) {
            if (!(c = scan(w, x)))
                goto fail_x;
            if (c == Py_None) {
                Py_DECREF(x);
                Py_XDECREF(out);
                return c;
            }
            if (c == x)
                Py_CLEAR(c);
        } else if (w->refuse != Py_None) {
            int r = refused(w, x);
            if (r < 0)
                goto fail_x;
            if (r) {
                Py_DECREF(x);
                Py_XDECREF(out);
                Py_RETURN_NONE;
            }
        }
        Py_DECREF(x);
        if (c) {
            if (!out) {
                Py_ssize_t n = seq_size(seq);
                out = tuple ? PyTuple_New(n) : PyList_GetSlice(seq, 0, n);
                for (Py_ssize_t j = 0; tuple && out && j < n; j++) {
                    PyObject *y = PyTuple_GetItem(seq, j);
                    Py_INCREF(y);
                    PyTuple_SetItem(out, j, y);
                }
                if (!out) {
                    Py_DECREF(c);
                    return NULL;
                }
            }
            if ((tuple ? PyTuple_SetItem(out, i, c) : PyList_SetItem(out, i, c)) < 0)
                goto fail;
        }
    }
    if (out)
        return out;
    Py_INCREF(seq);
    return seq;
fail_x:
    Py_DECREF(x);
fail:
    Py_XDECREF(out);
    return NULL;
}

/* policy.one_dtype(seq, seen) is False: 1 mixed, 0 one dtype or none, -1 error */
static int mixed(PyObject *seq, PyObject **seen)
{
    for (Py_ssize_t i = 0; i < seq_size(seq); i++) {
        PyObject *x = seq_item(seq, i);
        int t;
        if (!x)
            return -1;
        Py_INCREF(x);
        t = is_tensor(x);
        if (t > 0) {
            PyObject *d = dtype_of(x);
            t = d ? 0 : -1;
            if (d && (d == G.floats[0] || d == G.floats[1] || d == G.floats[2] || d == G.floats[3])) {
                if (!*seen)
                    *seen = d;
                else if (d != *seen)
                    t = 1;
            }
        } else if (!t && (PyList_CheckExact(x) || PyTuple_CheckExact(x))) {
            t = mixed(x, seen);
        }
        Py_DECREF(x);
        if (t)
            return t;
    }
    return 0;
}

/* rule(args, kwargs) -> (a, k) as new references, a a tuple, k a dict */
static int prepare(PyObject *rule, PyObject *args, PyObject *kw, PyObject **a, PyObject **k)
{
    PyObject *r = PyObject_CallFunctionObjArgs(rule, args, kw, NULL);
    if (!r)
        return -1;
    if (!PyTuple_Check(r) || PyTuple_Size(r) != 2) {
        Py_DECREF(r);
        PyErr_SetString(PyExc_TypeError, "prepare must return (args, kwargs)");
        return -1;
    }
    *a = PyTuple_GetItem(r, 0);
    *k = PyTuple_GetItem(r, 1);
    Py_INCREF(*a);
    Py_INCREF(*k);
    Py_DECREF(r);
    return 0;
}

/* the call op(*a, **k) for any sequence a and mapping k */
static PyObject *call_op(PyObject *op, PyObject *a, PyObject *k)
{
    PyObject *t = a, *d = k, *r;
    if (!PyTuple_Check(a) && !(t = PySequence_Tuple(a)))
        return NULL;
    if (k && !PyDict_Check(k)) {
        if ((d = PyDict_New()) && PyDict_Merge(d, k, 1) < 0)
            Py_CLEAR(d);
        if (!d) {
            if (t != a)
                Py_DECREF(t);
            return NULL;
        }
    }
    r = PyObject_Call(op, t, d && PyDict_Size(d) ? d : NULL);
    if (t != a)
        Py_DECREF(t);
    if (d != k)
        Py_DECREF(d);
    return r;
}

static PyObject *Wrapper_call(Wrapper *w, PyObject *args, PyObject *kwargs)
{
    /* read once: another thread's revert() may retire the wrapper meanwhile */
    PyObject *op = w->op, *rule = w->prepare, *kw = kwargs, *made = NULL;
    PyObject *a = NULL, *k = NULL, *result = NULL, *o;
    int v, general;
    if (!op) {
        PyErr_SetString(PyExc_TypeError, "hmp wrapper without op");
        return NULL;
    }
    Py_INCREF(op);
    Py_XINCREF(rule);
    if (!(o = PyObject_GetAttr(w->state, G.s_off)))
        goto done;
    v = PyObject_IsTrue(o);
    Py_DECREF(o);
    if (v < 0)
        goto done;
    if (v || !rule || rule == Py_None) {
        result = PyObject_Call(op, args, kwargs);
        goto done;
    }
    /* the Python hooks get a dict, the caller's or an empty one, made when first needed */
#define NEED_KW() (kw || (kw = made = PyDict_New()))
    if (w->needs != Py_None) {
        if (!NEED_KW() || !(o = PyObject_CallFunctionObjArgs(w->needs, args, kw, NULL)))
            goto done;
        v = PyObject_IsTrue(o);
        Py_DECREF(o);
        if (v <= 0) {
            if (!v)
                result = PyObject_Call(op, args, kwargs);
            goto done;
        }
    }
    general = w->src == Py_None || (kw && PyDict_Size(kw));
    if (!general && PyTuple_Size(args) > w->inplace_at) {
        if ((general = PyObject_IsTrue(PyTuple_GetItem(args, w->inplace_at))) < 0)
            goto done;
    }
    if (!general && w->promote) {
        PyObject *seen = NULL;
        if ((general = mixed(args, &seen)) < 0)
            goto done;
    } else if (!general) {
        a = w->decay ? PyObject_CallFunctionObjArgs(G.cast_seq, args, w->src, w->cast, w->refuse, NULL)
                     : scan(w, args);
        if (!a)
            goto done;
        if (a == Py_None) /* a number the lower dtype cannot hold: the FP32 rule */
            Py_CLEAR(a);
        general = !a;
    }
    if (general) {
        if (!NEED_KW() || prepare(rule, args, kw, &a, &k) < 0)
            goto done;
    } else {
        if (!a) {
            a = args;
            Py_INCREF(a);
        }
        k = kw; /* NULL when the caller gave none */
        Py_XINCREF(k);
    }

    if (PyObject_SetAttr(w->state, G.s_off, G.off) < 0)
        goto done;
    result = call_op(op, a, k);
    /* a write into a copy reaches the caller's tensor (after: Python) */
    if (result && w->hidden && (a != args || k != kw)) {
        o = PyObject_CallFunctionObjArgs(G.after, a, args, k ? k : Py_None, kw ? kw : Py_None, NULL);
        if (!o)
            Py_CLEAR(result);
        Py_XDECREF(o);
    }
    if (!result && PyErr_ExceptionMatches(PyExc_Exception)) {
        PyObject *et, *ev, *etb;
        PyErr_Fetch(&et, &ev, &etb);
        PyErr_NormalizeException(&et, &ev, &etb);
        if (etb)
            PyException_SetTraceback(ev, etb);
        if (!k && NEED_KW()) { /* unchanged keywords: k is kw, as rescue checks */
            k = kw;
            Py_INCREF(k);
        }
        result = kw ? PyObject_CallFunctionObjArgs(G.rescue, ev, op, w->wrapped ? w->wrapped : Py_None, args, kw,
                                                   a, k, NULL)
                    : NULL;
        if (result == G.raise) {
            Py_CLEAR(result);
            PyErr_Restore(et, ev, etb);
        } else {
            Py_XDECREF(et);
            Py_XDECREF(ev);
            Py_XDECREF(etb);
        }
    }
    {   /* casts back on, on every exit: st.off = 0 */
        PyObject *et, *ev, *etb;
        PyErr_Fetch(&et, &ev, &etb);
        if (PyObject_SetAttr(w->state, G.s_off, G.zero) < 0) {
            Py_CLEAR(result);
            Py_XDECREF(et);
            Py_XDECREF(ev);
            Py_XDECREF(etb);
        } else {
            PyErr_Restore(et, ev, etb);
        }
    }
done:
    Py_DECREF(op);
    Py_XDECREF(rule);
    Py_XDECREF(made);
    Py_XDECREF(a);
    Py_XDECREF(k);
    return result;
#undef NEED_KW
}

static PyObject *Wrapper_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"op", "prepare", "src", "cast", "refuse", "inplace_at", "hidden", "needs",
                            "state", "wrapped", NULL};
    PyObject *op, *prep, *src, *cast, *refuse, *needs, *state, *wrapped = Py_None;
    Py_ssize_t at;
    int hidden;
    Wrapper *w;
    if (!G.ready) {
        PyErr_SetString(PyExc_RuntimeError, "_cbody.setup() first");
        return NULL;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOOnpOO|O", names, &op, &prep, &src, &cast, &refuse, &at,
                                     &hidden, &needs, &state, &wrapped))
        return NULL;
    {
        allocfunc alloc = (allocfunc)PyType_GetSlot(type, Py_tp_alloc);
        if (!(w = (Wrapper *)alloc(type, 0)))
            return NULL;
    }
    w->inplace_at = at;
    w->hidden = hidden;
    w->promote = src == G.promote;
    if (src != Py_None && !w->promote) { /* a small set of dtypes */
        PyObject *it = PyObject_GetIter(src), *d;
        if (!it)
            goto fail;
        while ((d = PyIter_Next(it))) {
            if (w->nsrc == 4) {
                Py_DECREF(d);
                PyErr_SetString(PyExc_ValueError, "src: at most 4 dtypes");
                break;
            }
            w->srcs[w->nsrc++] = d; /* borrowed: src holds it */
            Py_DECREF(d);
        }
        Py_DECREF(it);
        if (PyErr_Occurred())
            goto fail;
    }
    if (refuse != Py_None) { /* refuse.decay (a multiplication): the scan stays Python */
        PyObject *d = PyObject_GetAttr(refuse, G.s_decay);
        if (!d)
            PyErr_Clear();
        else if ((w->decay = PyObject_IsTrue(d)) < 0)
            w->decay = 1, PyErr_Clear();
        Py_XDECREF(d);
    }
#define KEEP(f) Py_INCREF(f), w->f = f
    KEEP(op); KEEP(src); KEEP(cast); KEEP(refuse); KEEP(needs); KEEP(state); KEEP(wrapped);
    Py_INCREF(prep), w->prepare = prep;
#undef KEEP
    return (PyObject *)w;
fail:
    Py_DECREF(w);
    return NULL;
}

/* a method when stored on a class (torch.Tensor.mm), as a Python function is */
static PyObject *Wrapper_get(PyObject *self, PyObject *obj, PyObject *type)
{
    if (!obj || obj == Py_None) {
        Py_INCREF(self);
        return self;
    }
#ifdef Py_LIMITED_API
    return PyObject_CallFunctionObjArgs(G.method_type, self, obj, NULL);
#else
    return PyMethod_New(self, obj);
#endif
}

static int Wrapper_traverse(Wrapper *w, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(w));
    Py_VISIT(w->op); Py_VISIT(w->prepare); Py_VISIT(w->wrapped); Py_VISIT(w->src); Py_VISIT(w->cast);
    Py_VISIT(w->refuse); Py_VISIT(w->needs); Py_VISIT(w->state); Py_VISIT(w->dict);
    return 0;
}

static int Wrapper_clear(Wrapper *w)
{
    w->nsrc = 0;
    Py_CLEAR(w->op); Py_CLEAR(w->prepare); Py_CLEAR(w->wrapped); Py_CLEAR(w->src); Py_CLEAR(w->cast);
    Py_CLEAR(w->refuse); Py_CLEAR(w->needs); Py_CLEAR(w->state); Py_CLEAR(w->dict);
    return 0;
}

static void Wrapper_dealloc(Wrapper *w)
{
    PyTypeObject *tp = Py_TYPE(w);
    PyObject_GC_UnTrack(w);
    if (w->weaklist)
        PyObject_ClearWeakRefs((PyObject *)w);
    Wrapper_clear(w);
    ((freefunc)PyType_GetSlot(tp, Py_tp_free))(w);
    Py_DECREF(tp);
}

/* op and prepare are settable: pause/resume/retire write them */
static PyMemberDef Wrapper_members[] = {
    {"op", T_OBJECT, offsetof(Wrapper, op), 0, NULL},
    {"prepare", T_OBJECT, offsetof(Wrapper, prepare), 0, NULL},
    {"wrapped", T_OBJECT, offsetof(Wrapper, wrapped), READONLY, NULL},
    {"src", T_OBJECT, offsetof(Wrapper, src), READONLY, NULL},
    {"cast", T_OBJECT, offsetof(Wrapper, cast), READONLY, NULL},
    {"refuse", T_OBJECT, offsetof(Wrapper, refuse), READONLY, NULL},
    {"needs", T_OBJECT, offsetof(Wrapper, needs), READONLY, NULL},
    {"state", T_OBJECT, offsetof(Wrapper, state), READONLY, NULL},
    {"inplace_at", T_PYSSIZET, offsetof(Wrapper, inplace_at), READONLY, NULL},
    {"hidden", T_INT, offsetof(Wrapper, hidden), READONLY, NULL},
    {"__dictoffset__", T_PYSSIZET, offsetof(Wrapper, dict), READONLY, NULL},
    {"__weaklistoffset__", T_PYSSIZET, offsetof(Wrapper, weaklist), READONLY, NULL},
    {NULL},
};

/* __dict__ (functools.update_wrapper, hmp's marks); PyObject_GenericGetDict is abi3 from 3.10 only */
static PyObject *Wrapper_getdict(Wrapper *w, void *closure)
{
    if (!w->dict && !(w->dict = PyDict_New()))
        return NULL;
    Py_INCREF(w->dict);
    return w->dict;
}

static PyGetSetDef Wrapper_getset[] = {
    {"__dict__", (getter)Wrapper_getdict, NULL, NULL, NULL},
    {NULL},
};

static PyType_Slot Wrapper_slots[] = {
    {Py_tp_new, (void *)Wrapper_new},
    {Py_tp_call, (void *)Wrapper_call},
    {Py_tp_descr_get, (void *)Wrapper_get},
    {Py_tp_traverse, (void *)Wrapper_traverse},
    {Py_tp_clear, (void *)Wrapper_clear},
    {Py_tp_dealloc, (void *)Wrapper_dealloc},
    {Py_tp_members, (void *)Wrapper_members},
    {Py_tp_getset, (void *)Wrapper_getset},
    {Py_tp_doc, (void *)"hmp's per-call wrapper body (prototype)"},
    {0, NULL},
};

static PyType_Spec Wrapper_spec = {
    .name = MODULE_NAME ".Wrapper",
    .basicsize = sizeof(Wrapper),
    /* METHOD_DESCRIPTOR: x.mm(y) calls Wrapper(x, y) with no bound method made */
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_METHOD_DESCRIPTOR,
    .slots = Wrapper_slots,
};

static PyObject *setup(PyObject *mod, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"tensor", "parameter", "floats", "promote", "off", "cast_seq", "is_number",
                            "after", "rescue", "raise_", "method_type", NULL};
    PyObject *tensor, *parameter, *floats, *promote, *off, *cast_seq, *is_number, *after, *rescue, *raise,
        *method_type;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!O!O!OOOOOOOO", names, &PyType_Type, &tensor, &PyType_Type,
                                     &parameter, &PyTuple_Type, &floats, &promote, &off, &cast_seq, &is_number,
                                     &after, &rescue, &raise, &method_type))
        return NULL;
    if (PyTuple_Size(floats) != 4) {
        PyErr_SetString(PyExc_ValueError, "floats: the 4 floating dtypes");
        return NULL;
    }
    /* kept for the process: the references are never given back */
    Py_INCREF(floats);
    for (int i = 0; i < 4; i++)
        G.floats[i] = PyTuple_GetItem(floats, i);
#define KEEP(f, v) Py_INCREF(v), G.f = v
    KEEP(tensor, (PyTypeObject *)tensor); KEEP(parameter, (PyTypeObject *)parameter);
    KEEP(promote, promote); KEEP(off, off); KEEP(cast_seq, cast_seq); KEEP(is_number, is_number);
    KEEP(after, after); KEEP(rescue, rescue); KEEP(raise, raise); KEEP(method_type, method_type);
#undef KEEP
    G.ready = 1;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"setup", (PyCFunction)(void (*)(void))setup, METH_VARARGS | METH_KEYWORDS,
     "setup(tensor, parameter, floats, promote, off, cast_seq, is_number, after, rescue, raise_, method_type)"},
    {NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, MODULE_NAME, NULL, -1, methods};

#define INIT_NAME(n) PyInit_##n
#define INIT(n) INIT_NAME(n)

PyMODINIT_FUNC INIT(MODULE_ID)(void)
{
    PyObject *m = PyModule_Create(&module), *t;
    if (!m)
        return NULL;
    G.s_off = PyUnicode_InternFromString("off");
    G.s_dtype = PyUnicode_InternFromString("dtype");
    G.s_decay = PyUnicode_InternFromString("decay");
    G.zero = PyLong_FromLong(0);
    t = PyType_FromSpec(&Wrapper_spec);
    if (!t || PyModule_AddObject(m, "Wrapper", t) < 0) {
        Py_XDECREF(t);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
