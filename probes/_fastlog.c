/* The collective log's per-op hot path in C (trainprof.probes._fastlog).
 *
 * Tensor parallel issues ~50 functional collectives a step per rank, each intercepted twice (the
 * op and its wait_tensor). In Python the two proxies, the record and the completion cost ~30 us
 * per op inside a job (of which ~14 us in a hot loop): 1.4 % of the ranks' CPU on the 8-rank
 * reference, most of the collective log's share. Here the common case (one plain CPU tensor in,
 * one out, a known group) makes no Python frame: the same record dict, the same _Op
 * book-keeping, the same containers as collectives.py, which stays the reference implementation
 * and takes every other case (CUDA events, lists, unknown groups, p2p, kwargs). The same holds
 * for the c10d side (Method): the ProcessGroup methods that every torch.distributed API funnels
 * into (FSDP2's all-gather / reduce-scatter, pipelining's send / recv) and Work.wait.
 *
 * Nothing here may break the job: any failure on the probe's side of the fast path clears the
 * error and hands the call to the Python proxy (or to the op itself); errors of the op propagate
 * unchanged. No GIL is released and no torch header is used: tensors are read through their
 * Python methods, so any torch build works.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <time.h>

/* ------------------------------------------------------------------ state (one log at a time) */

static PyObject *g_log;      /* the CollectiveLog, or NULL: off */
static PyObject *g_clock;    /* StepClock: .step */
static PyObject *g_state;    /* session.state */
static PyObject *g_ops;      /* rid -> Op, until flushed */
static PyObject *g_inflight; /* rid -> record */
static PyObject *g_seq;      /* group name -> next sequence number */
static PyObject *g_funcol;   /* storage pointer of a functional op's output -> [Op] */
static PyObject *g_works;    /* id(Work) -> (Work, [Op]): c10d ops waiting for their wait() */
static PyObject *g_coalescing; /* id(ProcessGroup) -> [Op] issued inside _start/_end_coalescing */
static PyObject *g_groups;   /* group name or id -> (name, ranks, backend) */
static PyObject *g_dtypes;   /* torch.dtype -> (itemsize, name) */
static PyObject *g_tensor;   /* torch.Tensor */
static PyObject *g_compiling;  /* torch.compiler.is_compiling */
static PyObject *g_compiler_ns; /* vars(torch.compiler): its _is_compiling_flag, read directly */
static PyObject *g_cuda_event; /* () -> a recorded torch.cuda.Event */
static long long g_rid;
static PyObject *g_template; /* a record with every field: end_ns None, blocked_ms 0.0, ... */

static _Thread_local int t_busy; /* inside a recorded call: nested calls are the same wire op */

static PyObject *s_step, *s_pg, *s_seq, *s_op, *s_bytes, *s_dtype, *s_numel, *s_enqueue_ns,
    *s_end_ns, *s_blocked_ms, *s_device_ms, *s_peer, *s_async, *s_api, *s_replay, *s_nan_replay,
    *s_last_collective, *s_data_ptr, *s_storage_offset, *s_is_cuda, *s_elem, *s_flag;

static long long
now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts); /* time.time_ns(): the clock every record uses */
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* ------------------------------------------------------------------ Op: one issued op */

typedef struct {
    PyObject_HEAD
    long long rid;
    PyObject *rec;
    PyObject *work;
    PyObject *ev_start;
    PyObject *ev_end;
    PyObject *code;
    long long t_wait;
    int flushes;
    char sync;
    char done;
} Op;

static void
Op_dealloc(Op *o)
{
    Py_XDECREF(o->rec);
    Py_XDECREF(o->work);
    Py_XDECREF(o->ev_start);
    Py_XDECREF(o->ev_end);
    Py_XDECREF(o->code);
    Py_TYPE(o)->tp_free((PyObject *)o);
}

static int
Op_init(Op *o, PyObject *args, PyObject *kwds)
{
    static char *kw[] = {"rid", "rec", "sync", "code", NULL};
    long long rid;
    PyObject *rec, *code = Py_None;
    int sync;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "LOp|O", kw, &rid, &rec, &sync, &code))
        return -1;
    o->rid = rid;
    Py_INCREF(rec);
    Py_XSETREF(o->rec, rec);
    o->sync = (char)sync;
    Py_XSETREF(o->code, code == Py_None ? NULL : Py_NewRef(code));
    return 0;
}

static PyMemberDef Op_members[] = {
    {"rid", T_LONGLONG, offsetof(Op, rid), 0, NULL},
    {"rec", T_OBJECT, offsetof(Op, rec), 0, NULL},
    {"work", T_OBJECT, offsetof(Op, work), 0, NULL},
    {"ev_start", T_OBJECT, offsetof(Op, ev_start), 0, NULL},
    {"ev_end", T_OBJECT, offsetof(Op, ev_end), 0, NULL},
    {"code", T_OBJECT, offsetof(Op, code), 0, NULL},
    {"t_wait", T_LONGLONG, offsetof(Op, t_wait), 0, NULL},
    {"flushes", T_INT, offsetof(Op, flushes), 0, NULL},
    {"sync", T_BOOL, offsetof(Op, sync), 0, NULL},
    {"done", T_BOOL, offsetof(Op, done), 0, NULL},
    {NULL},
};

static PyTypeObject OpType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "trainprof.probes._fastlog.Op",
    .tp_doc = "Book-keeping of one issued op; rec is the public record (collectives.jsonl fields).",
    .tp_basicsize = sizeof(Op),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Op_init,
    .tp_dealloc = (destructor)Op_dealloc,
    .tp_members = Op_members,
};

/* ------------------------------------------------------------------ the record */

static int
set_item_steal(PyObject *d, PyObject *k, PyObject *v)
{
    if (v == NULL)
        return -1;
    int r = PyDict_SetItem(d, k, v);
    Py_DECREF(v);
    return r;
}

/* CollectiveLog.issue: a new record and Op, registered in-flight. New reference or NULL. */
static Op *
issue(PyObject *op, PyObject *name, long long nbytes, long long numel, PyObject *dtype,
      PyObject *peer, int is_async, PyObject *api, int cuda, int sync, PyObject *code)
{
    Op *o = NULL;
    PyObject *rec = NULL, *rid = NULL, *step = NULL;
    long long seq = 0;
    PyObject *cur = PyDict_GetItemWithError(g_seq, name); /* borrowed */
    if (cur != NULL) {
        seq = PyLong_AsLongLong(cur);
        if (seq == -1 && PyErr_Occurred())
            return NULL;
    }
    else if (PyErr_Occurred())
        return NULL;
    if (set_item_steal(g_seq, name, PyLong_FromLongLong(seq + 1)) < 0)
        return NULL;
    step = PyObject_GetAttr(g_clock, s_step);
    if (step == NULL)
        return NULL;
    /* a copy of the template has every key in place, in collectives.py's order: one
     * allocation, and the sets below replace values instead of growing the table */
    rec = PyDict_Copy(g_template);
    if (rec == NULL)
        goto fail;
    if (PyDict_SetItem(rec, s_step, step) < 0 || PyDict_SetItem(rec, s_pg, name) < 0 ||
        set_item_steal(rec, s_seq, PyLong_FromLongLong(seq)) < 0 ||
        PyDict_SetItem(rec, s_op, op) < 0 ||
        set_item_steal(rec, s_bytes, PyLong_FromLongLong(nbytes)) < 0 ||
        PyDict_SetItem(rec, s_dtype, dtype) < 0 ||
        set_item_steal(rec, s_numel, PyLong_FromLongLong(numel)) < 0 ||
        set_item_steal(rec, s_enqueue_ns, PyLong_FromLongLong(now_ns())) < 0 ||
        PyDict_SetItem(rec, s_peer, peer) < 0 ||
        PyDict_SetItem(rec, s_async, is_async ? Py_True : Py_False) < 0 ||
        PyDict_SetItem(rec, s_api, api) < 0)
        goto fail;
    PyObject *replay = PyDict_GetItemWithError(g_state, s_nan_replay);
    if (replay == NULL && PyErr_Occurred())
        goto fail;
    if (replay != NULL) {
        int t = PyObject_IsTrue(replay);
        if (t < 0 || (t && PyDict_SetItem(rec, s_replay, Py_True) < 0))
            goto fail;
    }
    o = PyObject_New(Op, &OpType);
    if (o == NULL)
        goto fail;
    o->rid = g_rid++;
    o->rec = Py_NewRef(rec);
    o->work = o->ev_start = o->ev_end = NULL;
    o->code = (code == NULL || code == Py_None) ? NULL : Py_NewRef(code);
    o->t_wait = 0;
    o->flushes = 0;
    o->sync = (char)sync;
    o->done = 0;
    if (cuda) {
        o->ev_start = PyObject_CallNoArgs(g_cuda_event);
        if (o->ev_start == NULL)
            goto fail;
    }
    rid = PyLong_FromLongLong(o->rid);
    if (rid == NULL || PyDict_SetItem(g_ops, rid, (PyObject *)o) < 0 ||
        PyDict_SetItem(g_inflight, rid, rec) < 0 ||
        PyDict_SetItem(g_state, s_last_collective, rec) < 0)
        goto fail;
    Py_DECREF(rid);
    Py_DECREF(rec);
    Py_DECREF(step);
    return o;
fail:
    Py_XDECREF(rid);
    Py_XDECREF((PyObject *)o);
    Py_XDECREF(rec);
    Py_XDECREF(step);
    return NULL;
}

/* CollectiveLog.complete. 0, or -1 with an exception. */
static int
complete(Op *o, long long t_end)
{
    if (o->done)
        return 0;
    PyObject *rec = o->rec;
    PyObject *end = PyDict_GetItemWithError(rec, s_end_ns);
    if (end == NULL && PyErr_Occurred())
        return -1;
    int later = 1;
    if (end != NULL && end != Py_None) {
        long long e = PyLong_AsLongLong(end);
        if (e == -1 && PyErr_Occurred())
            return -1;
        later = e > t_end;
    }
    if (later && set_item_steal(rec, s_end_ns, PyLong_FromLongLong(t_end)) < 0)
        return -1;
    long long blocked = o->t_wait;
    if (o->sync) {
        PyObject *enq = PyDict_GetItemWithError(rec, s_enqueue_ns);
        if (enq == NULL && PyErr_Occurred())
            return -1;
        if (enq != NULL) {
            long long e = PyLong_AsLongLong(enq);
            if (e == -1 && PyErr_Occurred())
                return -1;
            blocked = t_end - e;
        }
    }
    if (set_item_steal(rec, s_blocked_ms, PyFloat_FromDouble((double)blocked / 1e6)) < 0)
        return -1;
    if (o->ev_start != NULL) {
        PyObject *ev = PyObject_CallNoArgs(g_cuda_event);
        if (ev == NULL)
            return -1;
        Py_XSETREF(o->ev_end, ev);
    }
    o->done = 1;
    /* the job's Work (and the tensors it holds) goes when the job drops it, not at our flush */
    Py_CLEAR(o->work);
    PyObject *rid = PyLong_FromLongLong(o->rid);
    if (rid == NULL)
        return -1;
    if (PyDict_DelItem(g_inflight, rid) < 0) {
        if (!PyErr_ExceptionMatches(PyExc_KeyError)) {
            Py_DECREF(rid);
            return -1;
        }
        PyErr_Clear();
    }
    Py_DECREF(rid);
    return 0;
}

/* ------------------------------------------------------------------ helpers */

/* Is the log on and this call the outermost? (else: just run the op) */
static int
active(void)
{
    /* CollectiveLog.close() clears g_log (close_log): no attribute read per op */
    if (g_log == NULL || t_busy)
        return 0;
    /* under torch.compile / export tracing: the op alone. is_compiling() returns this module
     * flag outside TorchScript; reading it saves a Python call per op */
    if (g_compiler_ns != NULL) {
        PyObject *flag = PyDict_GetItemWithError(g_compiler_ns, s_flag);
        if (flag != NULL)
            return flag != Py_True;
        PyErr_Clear();
    }
    PyObject *comp = PyObject_CallNoArgs(g_compiling);
    if (comp == NULL) {
        PyErr_Clear();
        return 0;
    }
    int c = comp == Py_True;
    Py_DECREF(comp);
    return !c;
}

static long long
call_ll(PyObject *t, PyObject *method)
{
    PyObject *r = PyObject_CallMethodNoArgs(t, method);
    if (r == NULL)
        return -1;
    long long v = PyLong_AsLongLong(r);
    Py_DECREF(r);
    return v;
}

/* The storage pointer of a plain tensor: data_ptr - storage_offset * itemsize (no storage
 * object is made; collectives.py keys by untyped_storage().data_ptr(), the same number).
 * size: the itemsize, or 0 to read it from the dtype. -1 with no exception: not a plain tensor
 * or an unknown dtype. */
static long long
storage_key(PyObject *t, long long size)
{
    if ((PyObject *)Py_TYPE(t) != g_tensor)
        return -1;
    if (size <= 0) {
        PyObject *dt = PyObject_GetAttr(t, s_dtype);
        if (dt == NULL)
            goto err;
        PyObject *d = PyDict_GetItemWithError(g_dtypes, dt);
        Py_DECREF(dt);
        if (d == NULL)
            goto err;
        size = PyLong_AsLongLong(PyTuple_GET_ITEM(d, 0));
    }
    PyObject *p = PyObject_CallMethodNoArgs(t, s_data_ptr);
    if (p == NULL)
        goto err;
    long long ptr = PyLong_AsLongLong(p);
    Py_DECREF(p);
    PyObject *off = PyObject_CallMethodNoArgs(t, s_storage_offset);
    if (off == NULL)
        goto err;
    long long k = PyLong_AsLongLong(off);
    Py_DECREF(off);
    if (PyErr_Occurred())
        goto err;
    return ptr - k * size;
err:
    PyErr_Clear();
    return -1;
}

/* ------------------------------------------------------------------ the functional op proxy */

typedef struct {
    PyObject_HEAD
    PyObject *packet; /* the real OpOverloadPacket: attributes and identity */
    PyObject *call;   /* what calling the packet runs (its C++ _op when it has no torchbind) */
    PyObject *slow;   /* the Python proxy: every case the fast path does not take */
    PyObject *op;     /* canonical op name */
    PyObject *api;
    int arg, group_arg, times_n, wait;
} Proxy;

static void
Proxy_dealloc(Proxy *p)
{
    Py_XDECREF(p->packet);
    Py_XDECREF(p->call);
    Py_XDECREF(p->slow);
    Py_XDECREF(p->op);
    Py_XDECREF(p->api);
    Py_TYPE(p)->tp_free((PyObject *)p);
}

static int
Proxy_init(Proxy *p, PyObject *args, PyObject *kwds)
{
    static char *kw[] = {"packet", "call", "slow", "op", "api", "arg", "group_arg", "times_n",
                         "wait", NULL};
    PyObject *packet, *call, *slow, *op, *api;
    int arg, group_arg, times_n, wait;
    if (p->call != NULL) {
        PyErr_SetString(PyExc_TypeError, "Proxy is initialized once");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOOiipp", kw, &packet, &call, &slow, &op, &api,
                                     &arg, &group_arg, &times_n, &wait))
        return -1;
    Py_XSETREF(p->packet, Py_NewRef(packet));
    Py_XSETREF(p->call, Py_NewRef(call));
    Py_XSETREF(p->slow, Py_NewRef(slow));
    Py_XSETREF(p->op, Py_NewRef(op));
    Py_XSETREF(p->api, Py_NewRef(api));
    p->arg = arg;
    p->group_arg = group_arg;
    p->times_n = times_n;
    p->wait = wait;
    return 0;
}

/* Every call of the job's own op goes through here, and only those: a sampling profiler that
 * unwinds native frames (`benchmarks/bench_probe_attribution.py samples`) counts time below
 * this frame as the job's and time in any other frame of this file as the probe's. Not
 * inlined, and not a tail call (the flag is restored after), so the frame is always there. */
__attribute__((noinline)) static PyObject *
call_job(PyObject *fn, PyObject *args, PyObject *kwargs, int recorded)
{
    int prev = t_busy;
    if (recorded)
        t_busy = 1;
    Py_INCREF(fn); /* a re-init of the wrapper must not free it while it runs */
    PyObject *out = PyObject_Call(fn, args, kwargs);
    Py_DECREF(fn);
    t_busy = prev;
    return out;
}

/* numel and the dtype entry (itemsize, name) of a plain CPU tensor whose dtype was seen; *d
 * gets a new reference. -1 with no exception set for any other case (a first dtype, CUDA
 * events, not a tensor): the Python side takes those. Reading the tensor may run Python. */
static int
cpu_tensor_size(PyObject *t, long long *numel, PyObject **d)
{
    *d = NULL;
    if ((PyObject *)Py_TYPE(t) != g_tensor)
        return -1;
    PyObject *dt = PyObject_GetAttr(t, s_dtype);
    *d = dt ? Py_XNewRef(PyDict_GetItemWithError(g_dtypes, dt)) : NULL;
    Py_XDECREF(dt);
    if (*d == NULL || !PyTuple_CheckExact(*d) || PyTuple_GET_SIZE(*d) != 2)
        goto other;
    PyObject *cuda = PyObject_GetAttr(t, s_is_cuda);
    int on_cuda = cuda == NULL || cuda != Py_False;
    Py_XDECREF(cuda);
    if (on_cuda)
        goto other;
    long long size = PyLong_AsLongLong(PyTuple_GET_ITEM(*d, 0));
    PyObject *nobj = PyObject_CallMethodNoArgs(t, s_numel);
    *numel = -1;
    if (nobj != NULL) {
        *numel = PyLong_AsLongLong(nobj);
        Py_DECREF(nobj);
    }
    if (*numel < 0 || size <= 0 || PyErr_Occurred())
        goto other;
    return 0;
other:
    PyErr_Clear();
    Py_CLEAR(*d);
    return -1;
}

static PyObject *
issue_call(Proxy *p, PyObject *args, PyObject *kwargs)
{
    Py_ssize_t n = PyTuple_GET_SIZE(args);
    if ((kwargs != NULL && PyDict_GET_SIZE(kwargs)) || n <= p->arg || n <= p->group_arg)
        return PyObject_Call(p->slow, args, kwargs);
    PyObject *src = PyTuple_GET_ITEM(args, p->arg); /* held by the args tuple */
    /* owned: reading the tensor below may run Python (a TorchFunctionMode) */
    PyObject *info = Py_XNewRef(PyDict_GetItemWithError(g_groups, PyTuple_GET_ITEM(args, p->group_arg)));
    PyObject *d = NULL;
    long long numel = -1;
    if (info == NULL || !PyTuple_Check(info) || PyTuple_GET_SIZE(info) < 2)
        goto slow; /* the Python proxy resolves and caches the group */
    if (cpu_tensor_size(src, &numel, &d) < 0)
        goto slow;
    long long size = PyLong_AsLongLong(PyTuple_GET_ITEM(d, 0));
    if (p->times_n) {
        Py_ssize_t k = PyList_Check(PyTuple_GET_ITEM(info, 1)) ? PyList_GET_SIZE(PyTuple_GET_ITEM(info, 1)) : 0;
        numel *= k > 0 ? k : 1;
    }
    Op *o = issue(p->op, PyTuple_GET_ITEM(info, 0), numel * size, numel, PyTuple_GET_ITEM(d, 1),
                  Py_None, 1, p->api, 0, 0, NULL);
    Py_DECREF(info);
    Py_DECREF(d);
    if (o == NULL)
        PyErr_Clear(); /* the probe failed: the op still runs, unrecorded */
    PyObject *out = call_job(p->call, args, kwargs, 1);
    if (out == NULL || o == NULL) {
        Py_XDECREF((PyObject *)o);
        return out;
    }
    /* the output of these ops has the input's dtype */
    long long key = storage_key(out, size);
    if (key != -1) {
        PyObject *k = PyLong_FromLongLong(key);
        PyObject *prev = k ? PyDict_GetItemWithError(g_funcol, k) : NULL;
        if (prev != NULL && PyList_Check(prev)) /* a reused storage whose op was not waited */
            PyList_Append(prev, (PyObject *)o);
        else if (k != NULL && !PyErr_Occurred()) {
            PyObject *l = PyList_New(1);
            if (l != NULL) {
                PyList_SET_ITEM(l, 0, Py_NewRef((PyObject *)o));
                PyDict_SetItem(g_funcol, k, l);
                Py_DECREF(l);
            }
        }
        Py_XDECREF(k);
        PyErr_Clear();
    }
    else {
        /* a list or subclass output: the Python side keys it (never waited: closed at flush) */
        PyObject *r = PyObject_CallMethod(p->slow, "_key_outputs", "OO", out, (PyObject *)o);
        Py_XDECREF(r);
        PyErr_Clear();
    }
    Py_DECREF((PyObject *)o);
    return out;
slow:
    PyErr_Clear();
    Py_XDECREF(info);
    Py_XDECREF(d);
    return PyObject_Call(p->slow, args, kwargs);
}

static PyObject *
wait_call(Proxy *p, PyObject *args, PyObject *kwargs)
{
    if (PyDict_GET_SIZE(g_funcol) == 0 || PyTuple_GET_SIZE(args) < 1)
        return call_job(p->call, args, kwargs, 0);
    PyObject *t = PyTuple_GET_ITEM(args, 0);
    PyObject *elem = NULL;
    if ((PyObject *)Py_TYPE(t) != g_tensor) { /* an AsyncCollectiveTensor: its elem holds the storage */
        elem = PyObject_GetAttr(t, s_elem);
        if (elem == NULL) {
            PyErr_Clear();
            return call_job(p->call, args, kwargs, 0);
        }
        t = elem;
    }
    /* the tensor an op returned starts its storage: its data_ptr is the key (one call); a view
     * into it (an offset) needs the storage's start */
    PyObject *ops = NULL;
    long long key = (PyObject *)Py_TYPE(t) == g_tensor ? call_ll(t, s_data_ptr) : -1;
    for (int attempt = 0; attempt < 2 && ops == NULL; attempt++) {
        if (attempt == 1)
            key = storage_key(t, 0);
        if (key == -1) {
            PyErr_Clear();
            continue;
        }
        PyObject *k = PyLong_FromLongLong(key);
        if (k != NULL) {
            ops = PyDict_GetItemWithError(g_funcol, k);
            if (ops != NULL) {
                Py_INCREF(ops);
                PyDict_DelItem(g_funcol, k);
            }
            Py_DECREF(k);
        }
        PyErr_Clear();
    }
    Py_XDECREF(elem);
    if (ops == NULL)
        return call_job(p->call, args, kwargs, 0);
    long long t0 = now_ns();
    /* waiting on an AsyncCollectiveTensor dispatches to wait_tensor(elem) again: that inner call
     * is this same wait, no second lookup */
    PyObject *out = call_job(p->call, args, kwargs, 1);
    long long t1 = now_ns();
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    if (PyList_Check(ops)) {
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(ops); i++) {
            PyObject *x = PyList_GET_ITEM(ops, i);
            if (Py_TYPE(x) != &OpType)
                continue;
            ((Op *)x)->t_wait += t1 - t0;
            if (complete((Op *)x, t1) < 0)
                PyErr_Clear();
        }
    }
    Py_DECREF(ops);
    PyErr_Restore(et, ev, tb);
    return out;
}

static PyObject *
Proxy_call(Proxy *p, PyObject *args, PyObject *kwargs)
{
    if (p->call == NULL) {
        PyErr_SetString(PyExc_TypeError, "Proxy was not initialized");
        return NULL;
    }
    if (!active())
        return call_job(p->call, args, kwargs, 0);
    return p->wait ? wait_call(p, args, kwargs) : issue_call(p, args, kwargs);
}

static PyObject *
Proxy_getattro(Proxy *p, PyObject *name)
{
    /* own type attributes first (__class__, __call__), everything else from the real packet
     * (.default, .overloads(), ...), so code that inspects the op sees torch's */
    PyObject *r = PyObject_GenericGetAttr((PyObject *)p, name);
    if (r != NULL || !PyErr_ExceptionMatches(PyExc_AttributeError))
        return r;
    PyErr_Clear();
    return PyObject_GetAttr(p->packet, name);
}

static PyObject *
Proxy_repr(Proxy *p)
{
    return PyObject_Repr(p->packet);
}

static PyObject *
Proxy_get_packet(Proxy *p, void *closure)
{
    return Py_NewRef(p->packet);
}

static PyGetSetDef Proxy_getset[] = {
    {"_packet", (getter)Proxy_get_packet, NULL, NULL, NULL},
    {NULL},
};

static PyTypeObject ProxyType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "trainprof.probes._fastlog.Proxy",
    .tp_doc = "Stands in for a torch.ops._c10d_functional op packet (see collectives.py).",
    .tp_basicsize = sizeof(Proxy),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Proxy_init,
    .tp_dealloc = (destructor)Proxy_dealloc,
    .tp_call = (ternaryfunc)Proxy_call,
    .tp_getattro = (getattrofunc)Proxy_getattro,
    .tp_repr = (reprfunc)Proxy_repr,
    .tp_getset = Proxy_getset,
};

/* ------------------------------------------------------------------ c10d: ProcessGroup methods, Work.wait */

/* Stands in for a method of the pybind classes ProcessGroup (allreduce, _allgather_base, send,
 * ...) or Work (wait). A method descriptor: `pg.allreduce(...)` calls it with the instance first
 * and no bound method is made. The common case (a plain CPU tensor or [tensor], a known group
 * and call site, positional arguments) is handled here; every other goes to the Python wrapper
 * (slow), which is the reference implementation and fills the group and site caches. */
typedef struct {
    PyObject_HEAD
    PyObject *original; /* the pybind method */
    PyObject *slow;     /* the Python wrapper (None for Work.wait: it has no uncommon case) */
    PyObject *op;       /* canonical op name */
    PyObject *sites;    /* caller's code -> (api, the code if it waits on its Work itself) */
    PyObject *dict;     /* __name__, __doc__, _trainprof_original */
    int size_arg;       /* index (after self) of the argument whose size is the op's; -1: none */
    int p2p;            /* 1: peer = the group's rank args[1]; 2: any source (no peer) */
    int is_wait;        /* Work.wait */
} Method;

static int
Method_traverse(Method *m, visitproc visit, void *arg)
{
    Py_VISIT(m->original);
    Py_VISIT(m->slow);
    Py_VISIT(m->op);
    Py_VISIT(m->sites);
    Py_VISIT(m->dict);
    return 0;
}

static int
Method_clear(Method *m)
{
    Py_CLEAR(m->original);
    Py_CLEAR(m->slow);
    Py_CLEAR(m->op);
    Py_CLEAR(m->sites);
    Py_CLEAR(m->dict);
    return 0;
}

static void
Method_dealloc(Method *m)
{
    PyObject_GC_UnTrack(m);
    Method_clear(m);
    Py_TYPE(m)->tp_free((PyObject *)m);
}

static int
Method_init(Method *m, PyObject *args, PyObject *kwds)
{
    static char *kw[] = {"original", "slow", "op", "sites", "size_arg", "p2p", "is_wait", NULL};
    PyObject *original, *slow, *op, *sites;
    int size_arg, p2p, is_wait;
    if (m->original != NULL) {
        PyErr_SetString(PyExc_TypeError, "Method is initialized once");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOO!iip", kw, &original, &slow, &op,
                                     &PyDict_Type, &sites, &size_arg, &p2p, &is_wait))
        return -1;
    Py_XSETREF(m->original, Py_NewRef(original));
    Py_XSETREF(m->slow, Py_NewRef(slow));
    Py_XSETREF(m->op, Py_NewRef(op));
    Py_XSETREF(m->sites, Py_NewRef(sites));
    m->size_arg = size_arg;
    m->p2p = p2p;
    m->is_wait = is_wait;
    return 0;
}

/* The code object of the Python function that called the method (sys._getframe(1) of a
 * Python wrapper: this C call makes no frame). New reference or NULL (no error set). */
static PyObject *
caller_code(void)
{
    PyFrameObject *f = PyEval_GetFrame(); /* borrowed */
    return f != NULL ? (PyObject *)PyFrame_GetCode(f) : NULL;
}

/* Work.wait: time the wait, then close the ops that the Work carries (CollectiveLog.waited). */
static PyObject *
work_wait(Method *m, PyObject *args, PyObject *kwargs)
{
    if (g_log == NULL || PyTuple_GET_SIZE(args) < 1 || PyDict_GET_SIZE(g_works) == 0)
        return call_job(m->original, args, kwargs, 0);
    PyObject *work = PyTuple_GET_ITEM(args, 0);
    PyObject *key = PyLong_FromVoidPtr(work); /* id(work) */
    PyObject *entry = key ? PyDict_GetItemWithError(g_works, key) : NULL;
    if (entry == NULL) {
        PyErr_Clear();
        Py_XDECREF(key);
        return call_job(m->original, args, kwargs, 0);
    }
    /* c10d functions called with async_op=False wait on their Work themselves: the waiter
     * being the op's issuing function means the caller was blocked for all of it */
    PyObject *waiter = caller_code();
    long long t0 = now_ns();
    PyObject *out = call_job(m->original, args, kwargs, 0);
    long long t1 = now_ns();
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    entry = PyDict_GetItemWithError(g_works, key); /* the wait ran Python: look again */
    if (entry != NULL) {
        Py_INCREF(entry);
        PyDict_DelItem(g_works, key);
        if (PyTuple_Check(entry) && PyTuple_GET_SIZE(entry) == 2 &&
            PyTuple_GET_ITEM(entry, 0) == work && PyList_Check(PyTuple_GET_ITEM(entry, 1))) {
            PyObject *ops = PyTuple_GET_ITEM(entry, 1);
            for (Py_ssize_t i = 0; i < PyList_GET_SIZE(ops); i++) {
                PyObject *x = PyList_GET_ITEM(ops, i);
                if (Py_TYPE(x) != &OpType)
                    continue;
                Op *o = (Op *)x;
                if (o->code != NULL && o->code == waiter) {
                    o->sync = 1;
                    if (PyDict_SetItem(o->rec, s_async, Py_False) < 0)
                        PyErr_Clear();
                }
                o->t_wait += t1 - t0;
                if (complete(o, t1) < 0)
                    PyErr_Clear();
            }
        }
        Py_DECREF(entry);
    }
    PyErr_Clear();
    PyErr_Restore(et, ev, tb);
    Py_XDECREF(waiter);
    Py_DECREF(key);
    return out;
}

/* After the op was issued: hand the Op to its Work (CollectiveLog.attach_work), or to the
 * coalescing batch its group is in. Errors are the probe's: cleared. */
static void
attach_work(Op *o, PyObject *pg_key, PyObject *work)
{
    if (PyDict_GET_SIZE(g_coalescing) > 0) {
        PyObject *co = PyDict_GetItemWithError(g_coalescing, pg_key);
        if (co != NULL && PyList_Check(co)) { /* the batch's Work comes from _end_coalescing */
            PyList_Append(co, (PyObject *)o);
            PyErr_Clear();
            return;
        }
    }
    PyErr_Clear();
    if (work == Py_None) { /* the backend completed the op inside the call */
        if (o->code != NULL) {
            o->sync = 1;
            if (PyDict_SetItem(o->rec, s_async, Py_False) < 0)
                PyErr_Clear();
        }
        complete(o, now_ns());
        PyErr_Clear();
        return;
    }
    PyObject *key = PyLong_FromVoidPtr(work);
    PyObject *entry = key ? PyDict_GetItemWithError(g_works, key) : NULL;
    if (entry != NULL && PyTuple_Check(entry) && PyTuple_GET_SIZE(entry) == 2 &&
        PyTuple_GET_ITEM(entry, 0) == work && PyList_Check(PyTuple_GET_ITEM(entry, 1))) {
        PyList_Append(PyTuple_GET_ITEM(entry, 1), (PyObject *)o);
    }
    else if (key != NULL && !PyErr_Occurred()) { /* a new Work */
        PyObject *ops = PyList_New(1);
        if (ops != NULL) {
            PyList_SET_ITEM(ops, 0, Py_NewRef((PyObject *)o));
            PyObject *t = PyTuple_Pack(2, work, ops);
            if (t != NULL) {
                PyDict_SetItem(g_works, key, t);
                Py_DECREF(t);
            }
            Py_DECREF(ops);
        }
    }
    Py_XSETREF(o->work, Py_NewRef(work));
    Py_XDECREF(key);
    PyErr_Clear();
}

/* A ProcessGroup method: the record, the op with the busy flag set, the Work's book-keeping. */
static PyObject *
pg_call(Method *m, PyObject *args, PyObject *kwargs)
{
    if (g_log == NULL || t_busy)
        return call_job(m->original, args, kwargs, 0);
    Py_ssize_t n = PyTuple_GET_SIZE(args);
    if ((kwargs != NULL && PyDict_GET_SIZE(kwargs)) || m->size_arg < 0 || n <= 1 + m->size_arg)
        return PyObject_Call(m->slow, args, kwargs);
    /* owned from here: reading the tensor may run Python (a TorchFunctionMode) */
    PyObject *info = NULL, *site = NULL, *x = NULL, *d = NULL, *peer = NULL;
    long long numel = -1;
    PyObject *pg_key = PyLong_FromVoidPtr(PyTuple_GET_ITEM(args, 0)); /* id(pg) */
    if (pg_key == NULL)
        goto slow;
    info = Py_XNewRef(PyDict_GetItemWithError(g_groups, pg_key));
    if (info == NULL || !PyTuple_Check(info) || PyTuple_GET_SIZE(info) < 2)
        goto slow; /* the Python wrapper resolves and caches the group */
    PyObject *code = caller_code();
    site = code != NULL ? Py_XNewRef(PyDict_GetItemWithError(m->sites, code)) : NULL;
    Py_XDECREF(code);
    if (site == NULL || !PyTuple_Check(site) || PyTuple_GET_SIZE(site) != 2)
        goto slow; /* and the call site */
    x = PyTuple_GET_ITEM(args, 1 + m->size_arg);
    if (PyList_CheckExact(x) && PyList_GET_SIZE(x) == 1) /* c10d passes [tensor] */
        x = PyList_GET_ITEM(x, 0);
    Py_INCREF(x);
    if (cpu_tensor_size(x, &numel, &d) < 0)
        goto slow;
    long long size = PyLong_AsLongLong(PyTuple_GET_ITEM(d, 0));
    peer = Py_NewRef(Py_None);
    PyObject *ranks = PyTuple_GET_ITEM(info, 1);
    if (m->p2p == 1 && n > 2) { /* args[1]: the peer's rank in the group */
        long r = PyLong_AsLong(PyTuple_GET_ITEM(args, 2));
        Py_SETREF(peer, NULL);
        if (r == -1 && PyErr_Occurred())
            goto slow;
        if (PyList_Check(ranks) && PyList_GET_SIZE(ranks) > 0) /* its global rank */
            peer = (r >= 0 && r < PyList_GET_SIZE(ranks)) ? Py_NewRef(PyList_GET_ITEM(ranks, r)) : NULL;
        else
            peer = PyLong_FromLong(r);
        if (peer == NULL)
            goto slow; /* the wrapper records no peer */
    }
    PyObject *waits = PyTuple_GET_ITEM(site, 1);
    Op *o = issue(m->op, PyTuple_GET_ITEM(info, 0), numel * size, numel, PyTuple_GET_ITEM(d, 1),
                  peer, 1, PyTuple_GET_ITEM(site, 0), 0, 0, waits == Py_None ? NULL : waits);
    Py_DECREF(peer);
    Py_DECREF(info);
    Py_DECREF(site);
    Py_DECREF(x);
    Py_DECREF(d);
    if (o == NULL) {
        PyErr_Clear(); /* the probe failed: the op still runs, unrecorded */
        Py_DECREF(pg_key);
        return call_job(m->original, args, kwargs, 0);
    }
    PyObject *work = call_job(m->original, args, kwargs, 1);
    if (work != NULL)
        attach_work(o, pg_key, work); /* an op that raised stays in flight until the flush */
    Py_DECREF((PyObject *)o);
    Py_DECREF(pg_key);
    return work;
slow:
    PyErr_Clear();
    Py_XDECREF(pg_key);
    Py_XDECREF(info);
    Py_XDECREF(site);
    Py_XDECREF(x);
    Py_XDECREF(d);
    Py_XDECREF(peer);
    return PyObject_Call(m->slow, args, kwargs);
}

static PyObject *
Method_call(Method *m, PyObject *args, PyObject *kwargs)
{
    if (m->original == NULL || m->slow == NULL || m->sites == NULL || m->op == NULL) {
        PyErr_SetString(PyExc_TypeError, "Method was not initialized");
        return NULL;
    }
    return m->is_wait ? work_wait(m, args, kwargs) : pg_call(m, args, kwargs);
}

static PyObject *
Method_get(PyObject *self, PyObject *obj, PyObject *type)
{
    if (obj == NULL || obj == Py_None)
        return Py_NewRef(self); /* looked up on the class: the method itself */
    return PyMethod_New(self, obj);
}

static PyMemberDef Method_members[] = {
    {"_trainprof_original", T_OBJECT, offsetof(Method, original), READONLY, NULL},
    {NULL},
};

static PyGetSetDef Method_getset[] = {
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, NULL, NULL},
    {NULL},
};

static PyTypeObject MethodType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "trainprof.probes._fastlog.Method",
    .tp_doc = "Stands in for a ProcessGroup method or Work.wait (see collectives.py).",
    .tp_basicsize = sizeof(Method),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_METHOD_DESCRIPTOR | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Method_init,
    .tp_dealloc = (destructor)Method_dealloc,
    .tp_free = PyObject_GC_Del,
    .tp_traverse = (traverseproc)Method_traverse,
    .tp_clear = (inquiry)Method_clear,
    .tp_call = (ternaryfunc)Method_call,
    .tp_descr_get = Method_get,
    .tp_dictoffset = offsetof(Method, dict),
    .tp_members = Method_members,
    .tp_getset = Method_getset,
};

/* ------------------------------------------------------------------ module functions */

static PyObject *
m_configure(PyObject *self, PyObject *args)
{
    PyObject *log, *dtypes, *tensor, *compiling, *cuda_event;
    if (!PyArg_ParseTuple(args, "OOOOO", &log, &dtypes, &tensor, &compiling, &cuda_event))
        return NULL;
    if (log == Py_None) {
        Py_CLEAR(g_log);
        Py_RETURN_NONE;
    }
    PyObject *clock = PyObject_GetAttrString(log, "clock");
    PyObject *state = PyObject_GetAttrString(log, "state");
    PyObject *ops = PyObject_GetAttrString(log, "_ops");
    PyObject *inflight = PyObject_GetAttrString(log, "inflight");
    PyObject *seq = PyObject_GetAttrString(log, "_seq");
    PyObject *funcol = PyObject_GetAttrString(log, "_funcol");
    PyObject *groups = PyObject_GetAttrString(log, "_groups");
    PyObject *works = PyObject_GetAttrString(log, "_works");
    PyObject *coalescing = PyObject_GetAttrString(log, "_coalescing");
    if (!clock || !state || !ops || !inflight || !seq || !funcol || !groups || !works ||
        !coalescing || !PyDict_Check(state) || !PyDict_Check(ops) || !PyDict_Check(inflight) ||
        !PyDict_Check(seq) || !PyDict_Check(funcol) || !PyDict_Check(groups) ||
        !PyDict_Check(works) || !PyDict_Check(coalescing) || !PyDict_Check(dtypes)) {
        Py_XDECREF(works);
        Py_XDECREF(coalescing);
        Py_XDECREF(clock);
        Py_XDECREF(state);
        Py_XDECREF(ops);
        Py_XDECREF(inflight);
        Py_XDECREF(seq);
        Py_XDECREF(funcol);
        Py_XDECREF(groups);
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "configure: the log's containers must be dicts");
        return NULL;
    }
    Py_XSETREF(g_clock, clock);
    Py_XSETREF(g_state, state);
    Py_XSETREF(g_ops, ops);
    Py_XSETREF(g_inflight, inflight);
    Py_XSETREF(g_seq, seq);
    Py_XSETREF(g_funcol, funcol);
    Py_XSETREF(g_groups, groups);
    Py_XSETREF(g_works, works);
    Py_XSETREF(g_coalescing, coalescing);
    Py_XSETREF(g_dtypes, Py_NewRef(dtypes));
    Py_XSETREF(g_tensor, Py_NewRef(tensor));
    Py_XSETREF(g_compiling, Py_NewRef(compiling));
    /* the function's own module globals hold the flag */
    PyObject *globals = PyFunction_Check(compiling) ? PyFunction_GetGlobals(compiling) : NULL;
    Py_XSETREF(g_compiler_ns, globals != NULL && PyDict_Check(globals) ? Py_NewRef(globals) : NULL);
    Py_XSETREF(g_cuda_event, Py_NewRef(cuda_event));
    Py_XSETREF(g_log, Py_NewRef(log));
    g_rid = 0;
    Py_RETURN_NONE;
}

static PyObject *
m_issue(PyObject *self, PyObject *args, PyObject *kwds)
{
    static char *kw[] = {"op", "pg_info", "nbytes", "numel", "dtype", "peer", "is_async", "api",
                         "cuda", "sync", "code", NULL};
    PyObject *op, *info, *dtype, *peer, *api, *code = Py_None;
    long long nbytes, numel;
    int is_async, cuda, sync;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOLLOOpOpp|O", kw, &op, &info, &nbytes, &numel,
                                     &dtype, &peer, &is_async, &api, &cuda, &sync, &code))
        return NULL;
    if (g_log == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "_fastlog is not configured");
        return NULL;
    }
    if (!PyTuple_Check(info) || PyTuple_GET_SIZE(info) < 1) {
        PyErr_SetString(PyExc_TypeError, "issue: group info must be (name, ranks, backend)");
        return NULL;
    }
    return (PyObject *)issue(op, PyTuple_GET_ITEM(info, 0), nbytes, numel, dtype, peer, is_async,
                             api, cuda, sync, code);
}

static PyObject *
m_complete(PyObject *self, PyObject *args)
{
    PyObject *o;
    long long t;
    if (!PyArg_ParseTuple(args, "O!L", &OpType, &o, &t))
        return NULL;
    if (g_inflight == NULL) { /* also after close: the flush completes what is left */
        PyErr_SetString(PyExc_RuntimeError, "_fastlog is not configured");
        return NULL;
    }
    if (complete((Op *)o, t) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *
m_close(PyObject *self, PyObject *log)
{
    if (g_log == log) /* a later session's log stays on */
        Py_CLEAR(g_log);
    Py_RETURN_NONE;
}

static PyObject *
m_busy(PyObject *self, PyObject *noargs)
{
    return PyBool_FromLong(t_busy);
}

static PyObject *
m_set_busy(PyObject *self, PyObject *v)
{
    t_busy = PyObject_IsTrue(v) == 1;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"configure", m_configure, METH_VARARGS,
     "configure(log, dtypes, Tensor, is_compiling, cuda_event): log into this CollectiveLog's "
     "containers (None: off)."},
    {"issue", (PyCFunction)(void (*)(void))m_issue, METH_VARARGS | METH_KEYWORDS,
     "CollectiveLog.issue: a new in-flight Op."},
    {"complete", m_complete, METH_VARARGS, "CollectiveLog.complete(op, t_end_ns)."},
    {"close", m_close, METH_O, "close(log): stop logging into this CollectiveLog."},
    {"busy", m_busy, METH_NOARGS, "Inside a recorded call on this thread?"},
    {"set_busy", m_set_busy, METH_O, "Mark this thread inside (True) or outside a recorded call."},
    {NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_fastlog", "The collective log's per-op hot path in C.", -1, methods,
};

PyMODINIT_FUNC
PyInit__fastlog(void)
{
#define INTERN(var, text)                               \
    if ((var = PyUnicode_InternFromString(text)) == NULL) \
        return NULL;
    INTERN(s_step, "step");
    INTERN(s_pg, "pg");
    INTERN(s_seq, "seq");
    INTERN(s_op, "op");
    INTERN(s_bytes, "bytes");
    INTERN(s_dtype, "dtype");
    INTERN(s_numel, "numel");
    INTERN(s_enqueue_ns, "enqueue_ns");
    INTERN(s_end_ns, "end_ns");
    INTERN(s_blocked_ms, "blocked_ms");
    INTERN(s_device_ms, "device_ms");
    INTERN(s_peer, "peer");
    INTERN(s_async, "async");
    INTERN(s_api, "api");
    INTERN(s_replay, "replay");
    INTERN(s_nan_replay, "nan_replay");
    INTERN(s_last_collective, "last_collective");
    INTERN(s_data_ptr, "data_ptr");
    INTERN(s_storage_offset, "storage_offset");
    INTERN(s_is_cuda, "is_cuda");
    INTERN(s_elem, "elem");
    INTERN(s_flag, "_is_compiling_flag");
#undef INTERN
    /* collectives.py's CollectiveLog.issue writes the fields in this order */
    PyObject *zero = PyFloat_FromDouble(0.0);
    g_template = PyDict_New();
    if (zero == NULL || g_template == NULL)
        goto fail_template;
    PyObject *keys[] = {s_step, s_pg, s_seq, s_op, s_bytes, s_dtype, s_numel, s_enqueue_ns,
                        s_end_ns, s_blocked_ms, s_device_ms, s_peer, s_async, s_api};
    for (size_t i = 0; i < sizeof(keys) / sizeof(keys[0]); i++)
        if (PyDict_SetItem(g_template, keys[i], keys[i] == s_blocked_ms ? zero : Py_None) < 0)
            goto fail_template;
    Py_DECREF(zero);
    if (PyType_Ready(&OpType) < 0 || PyType_Ready(&ProxyType) < 0 ||
        PyType_Ready(&MethodType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "Op", (PyObject *)&OpType) < 0 ||
        PyModule_AddObjectRef(m, "Proxy", (PyObject *)&ProxyType) < 0 ||
        PyModule_AddObjectRef(m, "Method", (PyObject *)&MethodType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
fail_template:
    Py_XDECREF(zero);
    Py_CLEAR(g_template);
    return NULL;
}
