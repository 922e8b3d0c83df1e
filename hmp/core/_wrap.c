/* hmp.core._wrap: the body of hmp's wrapper (hmp/core/wrap.py, _body) in C.

   CPython's limited API only (one abi3 binary for CPython 3.9 and newer), no
   libtorch: it reads dtypes and calls torch's ops through Python. Optional:
   when it is not built (no compiler at install), or HMP_PURE_PYTHON is set,
   or torch cannot trace it (torch.compiler.substitute_in_graph, torch 2.5),
   wrap.py's Python body runs, which is also what torch.compile traces for
   this one (wrap.py registers it as this type's __call__ polyfill).

   Wrapper(op, prepare, wrapped, src, cast, refuse, inplace_at, hidden, needs)
   does per call what _body's closure does; the parts that are not per-call
   fast paths stay Python and are handed in once by setup(): the promote
   rule's and every keyword call's prepare, the scan of a multiplication
   (policy.cast_seq with refuse.decay), hold, write-back, rescue. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#ifndef Py_TPFLAGS_METHOD_DESCRIPTOR /* the limited API of 3.9's headers leaves it out; its value is fixed */
#define Py_TPFLAGS_METHOD_DESCRIPTOR (1UL << 17)
#endif

#define CALL1(f, a) PyObject_CallFunctionObjArgs((f), (a), NULL)

/* Per process, from setup(): torch's types, hmp's constants and Python steps. */
static struct {
    PyTypeObject *tensor, *parameter;
    PyObject *floats[4]; /* policy.FLOATS: the promote rule's dtypes */
    PyObject *promote;   /* wrap.PROMOTE */
    PyObject *state;     /* state.tls */
    PyObject *off;       /* state.OFF */
    PyObject *cast_seq;  /* policy.cast_seq: the scan with refuse.decay */
    PyObject *is_number; /* policy.is_number(type) */
    PyObject *hold;      /* wrap.hold(result, fresh) */
    PyObject *after;     /* after(a, args, k, kwargs): write-back */
    PyObject *rescue;    /* fallback.rescue(exc, op, wrapped, args, kwargs, a, k) */
    PyObject *raise;     /* fallback.RAISE */
    PyObject *method_type; /* types.MethodType: the limited API has no PyMethod_New */
    PyObject *zero, *s_off, *s_dtype, *s_decay, *s_fresh, *s_qualname, *s_name, *s_module;
    int ready;
} G;

/* the wrapper's object fields, once: wrap.make's arguments (wrap._FIELDS), less inplace_at and hidden */
#define OBJECT_FIELDS(X) X(op) X(prepare) X(wrapped) X(src) X(cast) X(refuse) X(needs)
#define DECLARE(f) PyObject *f;

typedef struct {
    PyObject_HEAD
    OBJECT_FIELDS(DECLARE)
    Py_ssize_t inplace_at;
    int hidden;
    /* from src and refuse: */
    int promote, decay, nsrc;
    PyObject *srcs[4]; /* src's dtypes (src holds them), compared by identity */
    PyObject *dict, *weaklist;
} Wrapper;

/* isinstance(x, torch.Tensor), without a call for the usual non-tensors */
static int is_tensor(PyObject *x)
{
    PyTypeObject *t = Py_TYPE(x);
    if (t == G.tensor || t == G.parameter || PyType_IsSubtype(t, G.tensor))
        return 1;
    if (x == Py_None || t == &PyLong_Type || t == &PyFloat_Type || t == &PyBool_Type || t == &PyList_Type ||
        t == &PyTuple_Type || t == &PyUnicode_Type)
        return 0;
    return PyObject_IsInstance(x, (PyObject *)G.tensor);
}

/* x.dtype as a borrowed reference (torch keeps its dtype objects alive), NULL on error */
static PyObject *dtype_of(PyObject *x)
{
    PyObject *d = PyObject_GetAttr(x, G.s_dtype);
    Py_XDECREF(d);
    return d;
}

/* a tuple's or list's size and item (borrowed); a list's size is read again
   at each step, since a cast (Python) may run code that changes it */
#define seq_size(s) (PyTuple_Check(s) ? PyTuple_Size(s) : PyList_Size(s))
#define seq_item(s, i) (PyTuple_Check(s) ? PyTuple_GetItem(s, i) : PyList_GetItem(s, i))

/* policy.cast_seq's check of an item that is neither a tensor nor a
   list/tuple: 1 refuse, 0 fine, -1 error */
static int refused(Wrapper *w, PyObject *x)
{
    PyObject *num = x, *r;
    int v;
    if (!PyFloat_CheckExact(x) && !PyLong_CheckExact(x)) {
        if (x == Py_None || PyBool_Check(x) || PyUnicode_CheckExact(x))
            return 0;
        if (!(r = CALL1(G.is_number, (PyObject *)Py_TYPE(x))))
            return -1;
        v = PyObject_IsTrue(r);
        Py_DECREF(r);
        if (v <= 0)
            return v;
        if (!(num = PyNumber_Float(x))) /* numpy's numbers: by their exact value */
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

/* a copy of seq (a tuple or list) to put casts into */
static PyObject *copy_of(PyObject *seq)
{
    Py_ssize_t n = seq_size(seq);
    PyObject *out;
    if (!PyTuple_Check(seq))
        return PyList_GetSlice(seq, 0, n);
    if (!(out = PyTuple_New(n)))
        return NULL;
    for (Py_ssize_t j = 0; j < n; j++) {
        PyObject *y = PyTuple_GetItem(seq, j);
        Py_INCREF(y);
        PyTuple_SetItem(out, j, y);
    }
    return out;
}

/* policy.cast_seq without refuse.decay: a new reference to seq when nothing
   was cast, a new tuple/list when something was, Py_None when refuse says
   no (the FP32 rule), NULL on error */
static PyObject *scan(Wrapper *w, PyObject *seq)
{
    PyObject *out = NULL, *x, *c;
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
            int hit = 0;
            if (!d)
                goto fail_x;
            for (int k = 0; k < w->nsrc; k++)
                hit |= d == w->srcs[k];
            if (hit && !(c = CALL1(w->cast, x))) {
                /* a subclass that refuses the cast stays uncast */
                if (Py_TYPE(x) == G.tensor || Py_TYPE(x) == G.parameter || !PyErr_ExceptionMatches(PyExc_Exception))
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
            if (!out && !(out = copy_of(seq))) {
                Py_DECREF(c);
                return NULL;
            }
            /* steals c */
            if ((PyTuple_Check(out) ? PyTuple_SetItem(out, i, c) : PyList_SetItem(out, i, c)) < 0)
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

/* policy.one_dtype(seq, seen) is False: 1 mixed, 0 one floating dtype or none, -1 error */
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

/* rule(args, kwargs) -> (a, k) as new references */
static int run_rule(PyObject *rule, PyObject *args, PyObject *kw, PyObject **a, PyObject **k)
{
    PyObject *r = PyObject_CallFunctionObjArgs(rule, args, kw, NULL);
    if (!r)
        return -1;
    if (!PyTuple_Check(r) || PyTuple_Size(r) != 2) {
        Py_DECREF(r);
        PyErr_SetString(PyExc_TypeError, "hmp: a cast rule must return (args, kwargs)");
        return -1;
    }
    *a = PyTuple_GetItem(r, 0);
    *k = PyTuple_GetItem(r, 1);
    Py_INCREF(*a);
    Py_INCREF(*k);
    Py_DECREF(r);
    return 0;
}

/* op(*a, **k) for any sequence a and mapping k (or NULL) */
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

/* state.tls.fresh: the weight copies the cache made during this call, for
   the output's graph to hold (wrap.hold); cleared when the op raised */
static int after_fresh(PyObject *result)
{
    PyObject *fresh = PyObject_GetAttr(G.state, G.s_fresh), *r;
    Py_ssize_t n;
    if (!fresh)
        return -1;
    n = PyList_Check(fresh) ? PyList_Size(fresh) : 0;
    if (n > 0) {
        r = result ? PyObject_CallFunctionObjArgs(G.hold, result, fresh, NULL)
                   : (PyList_SetSlice(fresh, 0, n, NULL) < 0 ? NULL : (Py_INCREF(Py_None), Py_None));
        Py_DECREF(fresh);
        if (!r)
            return -1;
        Py_DECREF(r);
        return 0;
    }
    Py_DECREF(fresh);
    return 0;
}

static PyObject *Wrapper_call(Wrapper *w, PyObject *args, PyObject *kwargs)
{
    /* read once: another thread's revert() may retire the wrapper meanwhile;
       the call finishes under the configuration it began in */
    PyObject *op = w->op, *rule = w->prepare, *kw = kwargs, *made = NULL;
    PyObject *a = NULL, *k = NULL, *result = NULL, *o;
    int v, general;
    if (!op) {
        PyErr_SetString(PyExc_TypeError, "hmp: a wrapper without its op");
        return NULL;
    }
    Py_INCREF(op);
    Py_XINCREF(rule);
    if (!(o = PyObject_GetAttr(G.state, G.s_off)))
        goto done;
    v = PyObject_IsTrue(o);
    Py_DECREF(o);
    if (v < 0)
        goto done;
    if (v || !rule || rule == Py_None) {
        result = PyObject_Call(op, args, kwargs);
        goto done;
    }
    /* the Python steps get a dict: the caller's, or an empty one made when first needed */
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
    if (!general && PyTuple_Size(args) > w->inplace_at &&
        (general = PyObject_IsTrue(PyTuple_GetItem(args, w->inplace_at))) < 0)
        goto done;
    if (!general && w->promote) {
        PyObject *seen = NULL;
        if ((general = mixed(args, &seen)) < 0)
            goto done;
    } else if (!general) {
        a = w->decay ? PyObject_CallFunctionObjArgs(G.cast_seq, args, w->src, w->cast, w->refuse, NULL)
                     : scan(w, args);
        if (!a)
            goto done;
        if (a == Py_None) /* a number the lower dtype cannot hold: prepare runs the FP32 rule */
            Py_CLEAR(a);
        general = !a;
    }
    if (general) {
        if (!NEED_KW() || run_rule(rule, args, kw, &a, &k) < 0)
            goto done;
    } else {
        if (!a) {
            a = args;
            Py_INCREF(a);
        }
        k = kw; /* NULL when the caller gave none */
        Py_XINCREF(k);
    }

    if (PyObject_SetAttr(G.state, G.s_off, G.off) < 0)
        goto done;
    result = call_op(op, a, k);
    if (result && after_fresh(result) < 0)
        Py_CLEAR(result);
    /* a write into a copy reaches the caller's tensor */
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
        if (etb) /* none when the op is a C function: culprit reads that as "raised by the op" */
            PyException_SetTraceback(ev, etb);
        if (after_fresh(NULL) < 0 || !NEED_KW()) {
            Py_XDECREF(et);
            Py_XDECREF(ev);
            Py_XDECREF(etb);
        } else {
            if (!k) { /* keywords as given: k is kw, as rescue compares them */
                k = kw;
                Py_INCREF(k);
            }
            result = PyObject_CallFunctionObjArgs(G.rescue, ev, op, w->wrapped, args, kw, a, k, NULL);
            if (result == G.raise) {
                Py_CLEAR(result);
                PyErr_Restore(et, ev, etb);
            } else {
                Py_XDECREF(et);
                Py_XDECREF(ev);
                Py_XDECREF(etb);
            }
        }
    }
    { /* casts back on, on every exit */
        PyObject *et, *ev, *etb;
        PyErr_Fetch(&et, &ev, &etb);
        if (PyObject_SetAttr(G.state, G.s_off, G.zero) < 0) {
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

/* what src and refuse decide once: the dtypes to cast, the promote rule, a multiplication's scan */
static int derive(Wrapper *w)
{
    w->nsrc = 0;
    w->promote = w->src == G.promote;
    w->decay = 0;
    if (w->src != Py_None && !w->promote) {
        PyObject *it = PyObject_GetIter(w->src), *d;
        if (!it)
            return -1;
        while ((d = PyIter_Next(it))) {
            Py_DECREF(d); /* borrowed from here on: src holds it */
            if (w->nsrc == 4) {
                PyErr_SetString(PyExc_ValueError, "hmp: src holds at most 4 dtypes");
                break;
            }
            w->srcs[w->nsrc++] = d;
        }
        Py_DECREF(it);
        if (PyErr_Occurred())
            return -1;
    }
    if (w->refuse != Py_None) {
        PyObject *d = PyObject_GetAttr(w->refuse, G.s_decay);
        if (!d)
            return -1;
        w->decay = PyObject_IsTrue(d);
        Py_DECREF(d);
        if (w->decay < 0)
            return -1;
    }
    return 0;
}

#define SET(field, value) \
    do { \
        PyObject *old_ = w->field; \
        Py_INCREF(value); \
        w->field = (value); \
        Py_XDECREF(old_); \
    } while (0)

static PyObject *Wrapper_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"op", "prepare", "wrapped", "src", "cast", "refuse", "inplace_at", "hidden", "needs",
                            NULL};
    PyObject *op, *prepare, *wrapped, *src, *cast, *refuse, *needs;
    Py_ssize_t at;
    int hidden;
    Wrapper *w;
    if (!G.ready) {
        PyErr_SetString(PyExc_RuntimeError, "hmp.core._wrap: setup() first");
        return NULL;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOOOnpO", names, &op, &prepare, &wrapped, &src, &cast, &refuse,
                                     &at, &hidden, &needs))
        return NULL;
    if (!(w = (Wrapper *)((allocfunc)PyType_GetSlot(type, Py_tp_alloc))(type, 0)))
        return NULL;
    w->inplace_at = at;
    w->hidden = hidden;
#define FROM_ARGUMENT(f) SET(f, f);
    OBJECT_FIELDS(FROM_ARGUMENT)
    if (derive(w) < 0) {
        Py_DECREF(w);
        return NULL;
    }
    return (PyObject *)w;
}

/* wrap.adopt: everything donor (a wrapper of this type) does, w does from now on */
static PyObject *Wrapper_adopt(Wrapper *w, PyObject *donor)
{
    Wrapper *d = (Wrapper *)donor;
    if (Py_TYPE(donor) != Py_TYPE(w)) {
        PyErr_SetString(PyExc_TypeError, "hmp: adopt() takes a wrapper of the same kind");
        return NULL;
    }
#define FROM_DONOR(f) SET(f, d->f);
    OBJECT_FIELDS(FROM_DONOR)
    w->inplace_at = d->inplace_at;
    w->hidden = d->hidden;
    if (derive(w) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* pickled by name: by __name__ where its module holds it under that name
   (torch.mm, as torch's own pickles), else by __qualname__, as a function
   is (pickle then says what that name finds instead: a retired wrapper's
   name says what to do) */
static PyObject *Wrapper_reduce(PyObject *self, PyObject *unused)
{
    PyObject *name = PyObject_GetAttr(self, G.s_name), *modname, *mod = NULL, *found = NULL;
    if (!name)
        return NULL;
    if ((modname = PyObject_GetAttr(self, G.s_module)) && PyUnicode_Check(modname) &&
        (mod = PyImport_Import(modname)))
        found = PyObject_GetAttr(mod, name);
    PyErr_Clear();
    Py_XDECREF(modname);
    Py_XDECREF(mod);
    Py_XDECREF(found);
    if (found == self)
        return name;
    Py_DECREF(name);
    return PyObject_GetAttr(self, G.s_qualname);
}

/* <hmp wrapper linear>: the name it stands in for (functools.update_wrapper gave it) */
static PyObject *Wrapper_repr(PyObject *self)
{
    PyObject *name = PyObject_GetAttr(self, G.s_qualname), *r;
    if (!name) {
        PyErr_Clear();
        return PyUnicode_FromFormat("<hmp wrapper of %R>", ((Wrapper *)self)->op);
    }
    r = PyUnicode_FromFormat("<hmp wrapper %S>", name);
    Py_DECREF(name);
    return r;
}

/* a method when stored on a class (torch.Tensor.mm), as a function is */
static PyObject *Wrapper_get(PyObject *self, PyObject *obj, PyObject *type)
{
    if (!obj || obj == Py_None) {
        Py_INCREF(self);
        return self;
    }
    return PyObject_CallFunctionObjArgs(G.method_type, self, obj, NULL);
}

static int Wrapper_traverse(Wrapper *w, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(w));
#define VISIT(f) Py_VISIT(w->f);
    OBJECT_FIELDS(VISIT)
    Py_VISIT(w->dict);
    return 0;
}

static int Wrapper_clear(Wrapper *w)
{
    w->nsrc = 0;
#define CLEAR(f) Py_CLEAR(w->f);
    OBJECT_FIELDS(CLEAR)
    Py_CLEAR(w->dict);
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

/* each field's getter (None for a cleared one) */
#define GETTER(field) \
    static PyObject *get_##field(Wrapper *w, void *c) \
    { \
        PyObject *v = w->field ? w->field : Py_None; \
        Py_INCREF(v); \
        return v; \
    }
OBJECT_FIELDS(GETTER)

static int set_object(PyObject **slot, PyObject *v)
{
    PyObject *old = *slot;
    if (!v) {
        PyErr_SetString(PyExc_AttributeError, "hmp: a wrapper's fields cannot be deleted");
        return -1;
    }
    Py_INCREF(v);
    *slot = v;
    Py_XDECREF(old);
    return 0;
}

static int set_op(Wrapper *w, PyObject *v, void *c)
{
    return set_object(&w->op, v);
}

static int set_prepare(Wrapper *w, PyObject *v, void *c)
{
    return set_object(&w->prepare, v);
}

static PyObject *get_inplace_at(Wrapper *w, void *c)
{
    return PyLong_FromSsize_t(w->inplace_at);
}

static PyObject *get_hidden(Wrapper *w, void *c)
{
    return PyBool_FromLong(w->hidden);
}

/* __dict__: functools.update_wrapper and hmp's marks (PyObject_GenericGetDict is abi3 from 3.10 only) */
static PyObject *get_dict(Wrapper *w, void *c)
{
    if (!w->dict && !(w->dict = PyDict_New()))
        return NULL;
    Py_INCREF(w->dict);
    return w->dict;
}

static PyGetSetDef Wrapper_getset[] = {
    /* op and prepare are written (pause, resume, retire); the others are read by the polyfill */
    {"op", (getter)get_op, (setter)set_op, NULL, NULL},
    {"prepare", (getter)get_prepare, (setter)set_prepare, NULL, NULL},
#define READ_ONLY(f) {#f, (getter)get_##f, NULL, NULL, NULL},
    READ_ONLY(wrapped) READ_ONLY(src) READ_ONLY(cast) READ_ONLY(refuse) READ_ONLY(needs)
    {"inplace_at", (getter)get_inplace_at, NULL, NULL, NULL},
    {"hidden", (getter)get_hidden, NULL, NULL, NULL},
    {"__dict__", (getter)get_dict, NULL, NULL, NULL},
    {NULL},
};

static PyMethodDef Wrapper_methods[] = {
    {"adopt", (PyCFunction)Wrapper_adopt, METH_O, "adopt(donor): do from now on what donor does"},
    {"__reduce__", (PyCFunction)Wrapper_reduce, METH_NOARGS, NULL},
    {NULL},
};

/* the instance's dict and weak-reference list, where the limited API finds them (tp_dictoffset, tp_weaklistoffset) */
static PyMemberDef Wrapper_members[] = {
    {"__dictoffset__", T_PYSSIZET, offsetof(Wrapper, dict), READONLY, NULL},
    {"__weaklistoffset__", T_PYSSIZET, offsetof(Wrapper, weaklist), READONLY, NULL},
    {NULL},
};

static PyType_Slot Wrapper_slots[] = {
    {Py_tp_new, (void *)Wrapper_new},
    {Py_tp_call, (void *)Wrapper_call},
    {Py_tp_descr_get, (void *)Wrapper_get},
    {Py_tp_repr, (void *)Wrapper_repr},
    {Py_tp_traverse, (void *)Wrapper_traverse},
    {Py_tp_clear, (void *)Wrapper_clear},
    {Py_tp_dealloc, (void *)Wrapper_dealloc},
    {Py_tp_getset, (void *)Wrapper_getset},
    {Py_tp_methods, (void *)Wrapper_methods},
    {Py_tp_members, (void *)Wrapper_members},
    {Py_tp_doc, (void *)"hmp's wrapper of a C function (hmp/core/wrap.py's body, in C)"},
    {0, NULL},
};

static PyType_Spec Wrapper_spec = {
    .name = "hmp.core._wrap.Wrapper",
    .basicsize = sizeof(Wrapper),
    /* METHOD_DESCRIPTOR: x.mm(y) calls Wrapper(x, y) without making a bound method */
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_METHOD_DESCRIPTOR,
    .slots = Wrapper_slots,
};

static PyObject *setup(PyObject *mod, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"tensor", "parameter", "floats", "promote", "state", "off", "cast_seq", "is_number",
                            "hold", "after", "rescue", "raise_", "method_type", NULL};
    PyObject *tensor, *parameter, *floats, *promote, *state, *off, *cast_seq, *is_number, *hold, *after, *rescue,
        *raise, *method_type;
    if (G.ready) {
        PyErr_SetString(PyExc_RuntimeError, "hmp.core._wrap: setup() runs once");
        return NULL;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!O!O!OOOOOOOOOO", names, &PyType_Type, &tensor, &PyType_Type,
                                     &parameter, &PyTuple_Type, &floats, &promote, &state, &off, &cast_seq,
                                     &is_number, &hold, &after, &rescue, &raise, &method_type))
        return NULL;
    if (PyTuple_Size(floats) != 4) {
        PyErr_SetString(PyExc_ValueError, "hmp.core._wrap: floats holds the 4 floating dtypes");
        return NULL;
    }
    /* kept for the life of the process */
    Py_INCREF(floats);
    for (int i = 0; i < 4; i++)
        G.floats[i] = PyTuple_GetItem(floats, i);
#define KEEP(f, v) Py_INCREF(v), G.f = (v)
    KEEP(tensor, (PyTypeObject *)tensor);
    KEEP(parameter, (PyTypeObject *)parameter);
    KEEP(promote, promote);
    KEEP(state, state);
    KEEP(off, off);
    KEEP(cast_seq, cast_seq);
    KEEP(is_number, is_number);
    KEEP(hold, hold);
    KEEP(after, after);
    KEEP(rescue, rescue);
    KEEP(raise, raise);
    KEEP(method_type, method_type);
#undef KEEP
    G.ready = 1;
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"setup", (PyCFunction)(void (*)(void))setup, METH_VARARGS | METH_KEYWORDS,
     "setup(tensor, parameter, floats, promote, state, off, cast_seq, is_number, hold, after, rescue, raise_, "
     "method_type): what the wrapper body reads and calls, once per process"},
    {NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "hmp.core._wrap", NULL, -1, module_methods};

PyMODINIT_FUNC PyInit__wrap(void)
{
    PyObject *m = PyModule_Create(&module), *t;
    if (!m)
        return NULL;
    G.s_off = PyUnicode_InternFromString("off");
    G.s_dtype = PyUnicode_InternFromString("dtype");
    G.s_decay = PyUnicode_InternFromString("decay");
    G.s_fresh = PyUnicode_InternFromString("fresh");
    G.s_qualname = PyUnicode_InternFromString("__qualname__");
    G.s_name = PyUnicode_InternFromString("__name__");
    G.s_module = PyUnicode_InternFromString("__module__");
    G.zero = PyLong_FromLong(0);
    t = PyType_FromSpec(&Wrapper_spec);
    if (!t || PyModule_AddObject(m, "Wrapper", t) < 0) {
        Py_XDECREF(t);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
