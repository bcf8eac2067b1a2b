"""The machinery around the notebook: configuration, data, run files, devices, the
production training loop, the command line, hosted-notebook setup and figures.

It builds on the notebook's own parts (`the_annotated_transformer.py`), which
`notebook()` finds; nothing here defines the model, its settings, batching, loss,
update step, decoders or checkpoint averaging a second time. The few of them the
package's users reach as ``machinery.<name>`` are the notebook's, looked up there.
"""

from __future__ import annotations

from .config import (  # noqa: F401
    ATTENTION_PATHS,
    Config,
    POSITIONAL_KINDS,
    PRECISIONS,
    PRESETS,
    SAME_WEIGHTS,
    default_preset,
    device_problem,
    get_config,
    run_dir_for,
    weight_fields,
)
from .data import (  # noqa: F401
    CORPORA,
    Corpus,
    DataSource,
    Dataset,
    build_subwords,
    build_vocabs,
    default_data_dir,
    fetch_dataset,
    load_dataset,
    locate_dataset,
    locate_test_split,
    make_copy_data,
    make_tokenizer,
)
from .datafiles import (  # noqa: F401
    DataError,
    download,
    read_bounded,
    read_lines,
    read_parallel,
    read_stream,
    split_lines,
)
from .project import colab_url, project_url  # noqa: F401
from .runs import recipe_differences, results_table, run_or_load  # noqa: F401
from .table3view import read_table3  # noqa: F401
from .iwslt import (  # noqa: F401
    prepare_iwslt14,
)
from .runfiles import (  # noqa: F401
    CheckpointError,
    Position,
    RunDirectoryError,
    RunFiles,
    TrainingInterrupted,
    UnreadableCheckpoint,
    atomic_file,
    average_checkpoints,
    checkpoint_paths,
    checkpoint_subwords,
    epoch_updates,
    first_line,
    free_space,
    load_checkpoint,
    lock_run_dir,
    metrics_lines_upto,
    misnamed_checkpoints,
    open_run_dir,
    resume_position,
    save_checkpoint,
    sync_directory,
    write_atomic,
)
from .devices import (  # noqa: F401
    CLEAR_WIN,
    GLIBC_MALLOC_SETTINGS,
    StopRequest,
    _barrier,
    _distributed,
    allocator_note,
    allow_tf32,
    any_process,
    fast_fp16,
    measured_ratio,
    native_bf16,
    on_device,
    pick_faster,
    precision_candidates,
    process_group_backend,
    resolve_attention,
    resolve_device,
    resolve_precision,
    restore_rng,
    rng_state,
    seed_process,
    time_calls,
    unwrap,
)
from .training import (  # noqa: F401
    PREFETCH,
    Run,
    Trainer,
    TrainingDiverged,
    decide_compute,
    find_checkpoint,
    measure_compute,
    newest_readable_checkpoint,
    prefetched,
    probe_batch,
    resume,
    setup,
    train,
    train_epoch,
    update,
)
from .evaluation import (  # noqa: F401
    evaluate_loss,
    evaluate_test,
)
from .planning import (  # noqa: F401
    LONG_MINUTES,
    OVERSIZED,
    UpdateClock,
    plan_run,
    planned_updates,
)
from .figures import (  # noqa: F401
    ATTENTION_KINDS,
    ATTENTION_TITLES,
    attention_maps,
    attention_maps_json,
    draw_attention_head,
    draw_attention_overview,
    plot_curves,
    save_figure,
    sharpest_head,
    show_attention,
    show_figure,
    show_image,
)
from .cli import (  # noqa: F401
    COMMANDS,
    config_from_args,
    main,
    environment_problem,
    script,
    usage,
)
from .inference import (  # noqa: F401
    OneLineParser,
    config_from_dict,
    encode_sources,
    evaluation_pairs,
    inference_parser,
    load_for_inference,
    run_inference_command,
    skipped_message,
    translate_lines,
)
from .hosted import (  # noqa: F401
    HOSTED_PACKAGES,
    hosted_setup,
    hosted_setup_plan,
    is_hosted,
    iwslt_run_choice,
)
from .parts import (  # noqa: F401
    notebook,
)
from .translation import (  # noqa: F401
    translate,
)


# the notebook's definitions that the package's users reach through it (Parts 1 and 3)
FROM_THE_NOTEBOOK = (
    "ModelConfig",
    "MODEL_PRESETS",
    "IncrementalDecoder",
    "average_weights",
)


def __getattr__(name: str):
    """``machinery.ModelConfig`` and the others of FROM_THE_NOTEBOOK: the notebook's."""
    if name in FROM_THE_NOTEBOOK:
        return getattr(notebook(), name)
    raise AttributeError(f"module 'machinery' has no attribute {name!r}")
