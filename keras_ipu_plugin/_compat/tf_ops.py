"""TensorFlow's dispatch, op callbacks, gradient recording and error tracebacks.

Part of `_compat`, the one package that touches private Keras / TensorFlow
APIs (see its `__init__`)."""

import contextlib
import inspect
import re


# TensorFlow's type-based dispatch (`tf.experimental.dispatch_for_api`, public)
# consults its targets only for argument types registered as dispatchable,
# which only TensorFlow's internal API can do; and its lists of elementwise
# functions are private. Registering KerasTensor changes nothing by itself:
# with no target that accepts a call, TensorFlow goes on as before.


def make_dispatchable(cls):
    """Let TensorFlow's dispatch targets see arguments of type `cls`."""
    from tensorflow.python.util import dispatch

    dispatch.register_dispatchable_type(cls)


def add_fallback_dispatch(function, target):
    """Call `target(args, kwargs)` when `function` fails on its arguments
    (TensorFlow's first dispatch system, for functions its type-based one
    does not cover: `tf.einsum(equation, *inputs)` has var-positional
    inputs, which `tf.experimental.dispatch_for_api` refuses). `target`
    returns NotImplemented to let the function's own error through. Only
    `tf.__internal__` exports the dispatcher class."""
    from tensorflow.python.util import dispatch

    class _Fallback(dispatch.OpDispatcher):
        def handle(self, args, kwargs):
            result = target(args, kwargs)
            return self.NOT_SUPPORTED if result is NotImplemented else result

    _Fallback().register(function)


def tf_elementwise_functions():
    """`(unary, binary)`: TensorFlow's elementwise functions, as it lists
    them for `tf.experimental.dispatch_for_*_elementwise_apis`."""
    from tensorflow.python.util import dispatch

    return tuple(dispatch._UNARY_ELEMENTWISE_APIS), tuple(dispatch._BINARY_ELEMENTWISE_APIS)


def stop_gradient_recording():
    """A context in which no gradient tape records (TensorFlow's own
    `tf.recompute_grad` runs its forward pass so: the tape then keeps none
    of the segment's activations)."""
    from tensorflow.python.eager import record

    return record.stop_recording()


@contextlib.contextmanager
def op_callback(callback):
    """Within: `callback(op_type, inputs, attrs, outputs, op_name=None,
    graph=None)` is called after every TensorFlow op this thread runs
    eagerly (and every op it adds to a graph, with `graph` set).

    Why private: nothing public observes a variable being written
    (`tf.Variable.assign` and Keras's `Variable.assign` have no hook, and
    patching them would reach every thread). TensorFlow keeps op callbacks
    in its eager context's thread-local data, so other threads run as before.
    """
    from tensorflow.python.framework import op_callbacks

    op_callbacks.add_op_callback(callback)
    try:
        yield
    finally:
        op_callbacks.remove_op_callback(callback)


# TensorFlow filters its own frames out of the tracebacks of its errors
# (`traceback_utils.filter_traceback`); the frame of its filter stays, and
# holds the function it called (`fn`), TensorFlow's dispatch handler, whose
# target is a variable of its closure (`dispatch_target`). No public API
# says which function an error came from.
_TF_RANDOM_MODULES = re.compile(r"tensorflow[/\\.]python[/\\.]ops[/\\.]"
                                r"(stateless_|stateful_)?random_ops(\.py)?$")


def raised_in_tf_random_function(error):
    """Whether `error` was raised inside one of TensorFlow's random
    functions (`tf.random.normal(shape=(batch, dim))` on symbolic sizes)."""
    tb = error.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        called = frame.f_locals.get("fn") if frame.f_code.co_name == "error_handler" else None
        module = _module_called(called) if callable(called) else ""
        if _TF_RANDOM_MODULES.search(frame.f_code.co_filename) or _TF_RANDOM_MODULES.search(module):
            return True
        tb = tb.tb_next
    return False


def _module_called(function):
    try:
        function = inspect.unwrap(function)
        target = inspect.getclosurevars(function).nonlocals.get("dispatch_target")
    except (ValueError, TypeError):
        return ""
    return getattr(target if callable(target) else function, "__module__", None) or ""
