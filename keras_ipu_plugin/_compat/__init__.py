"""The one package that touches private Keras / TensorFlow APIs.

Keras 3 exposes no public way to do what the plugin is for, so this package
gives each private access a name that says what it is for, one module per
topic:

- `keras_graphs`: the nodes a symbolic call records and undoing them
  (`producing_node`, `node_lists_snapshot`, `record_call`, ...), how Keras
  calls a layer (`call_context`, `current_training`, the masks `__call__`
  adds), the functional model (`Functional`, `run_functional_graph`,
  `functional_nodes`, `output_structure`, ...);
- `keras_objects`: what Keras objects hold and how Keras trains them: a
  layer's own losses / variables / bookkeeping, a variable's strategy and
  stored value, TensorFlow's tracked containers, a built optimizer's
  per-variable state, Keras's step functions, `compile`'s settings, the
  symbolic build under a strategy;
- `tf_internals`: TensorFlow's dispatch and op callbacks, its stateful random
  draws and global random state, `tf.data` pipelines, and what the
  trace-time idioms wrap.

Every name is also reachable from the package itself (`_compat.call_context`),
which is how the rest of the plugin reads them. No other module imports
`keras.src` or `tensorflow.python`, or reads a private attribute of an object
it did not make (`tests/test_layering.py` checks both), so a Keras upgrade is
a change in this package.
"""

from keras_ipu_plugin._compat.keras_graphs import (  # noqa: F401
    KerasNode,
    OPERATION_BOOKKEEPING,
    Operation,
    batch_index_operations,
    broadcast_to_operation,
    converts_input_args,
    copied_operation,
    forget_nodes,
    in_shape_inference,
    is_input_node,
    keras_history,
    keras_mask,
    keras_tensor_like,
    node_arguments,
    node_fill_in,
    node_input_ids,
    node_input_tensors,
    node_lists_snapshot,
    node_outputs,
    producing_node,
    record_call,
    set_keras_mask,
    adopt_call_signature,
    call_context,
    call_context_args,
    call_takes_training_argument,
    current_training,
    masks_keras_would_pass,
    set_call_takes_training_argument,
    Functional,
    functional_nodes,
    inbound_nodes,
    graph_call_through,
    is_graph_model,
    output_structure,
    run_functional_graph,
    standardize_inputs,
)
from keras_ipu_plugin._compat.keras_objects import (  # noqa: F401
    OneReplicaSymbolicBuild,
    auto_jit_compile,
    compile_arguments,
    compile_config,
    loss_tracker,
    make_step_function,
    model_strategy,
    print_msg,
    reduces_across_workers,
    saving_to_hdf5,
    symbolic_build_from_one_replica,
    optimizer_knows,
    optimizer_own_variables,
    optimizer_slot_lists,
    optimizer_trainable_variables,
    replace_optimizer_variable,
    set_optimizer_state,
    set_optimizer_variables,
    KERAS_MODEL_CODE_MODULES,
    KERAS_OPERATION_MODULES,
    LAYER_BOOKKEEPING,
    SEED_GENERATOR_MODULES,
    TRACKABLE_PREFIX,
    added_loss,
    all_layers,
    auto_layer_name_base,
    clear_own_losses,
    constructor_config,
    is_keras_model_code,
    layer_bookkeeping_attributes,
    own_losses,
    own_variables,
    sub_layers,
    backing_variable,
    current_value,
    global_seed_generator_state,
    global_seed_variables,
    is_default_strategy,
    stateless_scope,
    stored_value,
    variable_signature,
    variable_strategy,
    writes_other_variables,
    NEVER_CONTAINERS,
    OWN_STORAGE,
    raw_container,
    restore_wrapper_bookkeeping,
    wrapper_bookkeeping,
)
from keras_ipu_plugin._compat.tf_internals import (  # noqa: F401
    eager_tensor_array_targets,
    segment_functions,
    set_tensor_array_element_shape,
    tensor_array_state,
    tensor_array_zeros,
    tensor_size_attributes,
    traced_idiom_targets,
    add_fallback_dispatch,
    make_dispatchable,
    op_callback,
    raised_in_tf_random_function,
    stop_gradient_recording,
    tf_elementwise_functions,
    dataset_is_batched,
    dataset_strategy,
    stateful_op_names,
    global_random_state,
    put_back_global_random_state,
    restore_stateful_draw_ops,
    swap_stateful_draw_ops,
)
