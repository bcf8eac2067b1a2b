# Everything runs inside .venv, created from the pinned requirements on first use.
PYTHON_SYSTEM ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
CONFIG ?= $(shell $(PY) -c "import machinery; print(machinery.default_preset())")
RUN ?= runs/$(CONFIG)
ARGS ?=
NB := annotated_transformer.ipynb
SRC := the_annotated_transformer.py

# glibc's malloc gives large freed blocks back to the system, so every CPU training step would get
# fresh pages for its largest tensors; these keep freed memory for reuse (GLIBC_MALLOC_SETTINGS in
# machinery/devices.py, which a test keeps equal to these). Other C libraries ignore them; a value
# already in the environment wins.
export MALLOC_MMAP_MAX_ ?= 0
export MALLOC_TRIM_THRESHOLD_ ?= 17179869184

# Idle OpenMP threads wait passively (sleep) rather than spin, so training, evaluation,
# translation and the benchmarks keep their speed beside other work (WAIT_POLICY in
# machinery/devices.py, which a test keeps equal to this; its comment says why). The
# runtime reads it when it starts; a value already in the environment wins.
export OMP_WAIT_POLICY ?= PASSIVE

.PHONY: install install-cluster test sync notebook lab html train translate evaluate export bench gpu-check table3 seeds clean help

help:
	@echo "make install            create .venv and install requirements.txt"
	@echo "make install-cluster    add Table 3's optional engines (Ray, submitit) to .venv"
	@echo "make test               run the test suite (pytest)"
	@echo "make sync               bring $(NB) and $(SRC) up to date with each other"
	@echo "make notebook           execute the notebook top to bottom and store its outputs"
	@echo "make lab                open the notebook in JupyterLab (from .venv)"
	@echo "make html               build the notebook as an offline web page, site/index.html"
	@echo "make train [CONFIG=..]  train a preset (default: iwslt14-small with CUDA, else iwslt14-sample); ARGS='--field value ...'"
	@echo "make translate TEXT='Ein Satz.'  translate with the shipped model (or RUN=dir, CONFIG=name)"
	@echo "make evaluate [ARGS='--src F --ref F']  its BLEU (default: the test split)"
	@echo "make export CONFIG=name [ARGS=--score]  the run in RUN as a model folder in models/"
	@echo "make bench              performance side by side (a few minutes); ARGS=--quick for seconds"
	@echo "make gpu-check ARGS='--data DIR'  the ten-minute check on one CUDA GPU (JSON in build/gpu-check/); a CPU runs it tiny"
	@echo "make table3             the Table 3 runs (benchmarks/table3.py); ARGS='...'"
	@echo "make seeds              the headline preset with seeds 2 and 3 (benchmarks/seeds.py)"

install: $(STAMP)

$(STAMP): requirements.txt
	$(PYTHON_SYSTEM) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -r requirements.txt
	touch $(STAMP)

# Table 3's optional engines (`make table3 ARGS="--engine ray|slurm"`), their exact pins
# in requirements-cluster.txt; make install, training and the notebook never need them.
install-cluster: $(STAMP)
	$(PY) -m pip install -r requirements-cluster.txt

test: $(STAMP)
	$(PY) -m pytest -q tests

sync: $(STAMP)
	$(VENV)/bin/jupytext --sync $(SRC)

# Outputs are stored without per-cell execution timestamps (record_timing=False, and any left
# from earlier runs removed), so a re-run's diff shows only outputs that changed.
notebook: $(STAMP) sync
	$(VENV)/bin/jupyter nbconvert --to notebook --execute --inplace \
		--ExecutePreprocessor.timeout=-1 --ExecutePreprocessor.kernel_name=python3 \
		--ExecutePreprocessor.record_timing=False $(NB)
	$(PY) -c 'import nbformat, sys; nb = nbformat.read(sys.argv[1], as_version=4); \
		[c.metadata.pop("execution", None) for c in nb.cells]; nbformat.write(nb, sys.argv[1])' $(NB)
	$(VENV)/bin/jupytext --sync $(NB)

# Jupyter refuses to start as root unless told --allow-root; containers and hosted machines
# often run as root, so the flag is added there only, never for an ordinary user.
USER_ID ?= $(shell id -u)
lab: $(STAMP)
	$(VENV)/bin/jupyter lab $(if $(filter 0,$(USER_ID)),--allow-root) $(NB)

# The notebook with its stored outputs as one page that loads nothing from the network.
html: $(STAMP)
	$(PY) web/build.py

train: $(STAMP)
	$(PY) $(SRC) train --config $(CONFIG) $(ARGS)

# translate and evaluate use the run named by RUN or CONFIG on the command line, else
# the shipped model (models/multi30k-small); TEXT="..." is one sentence to translate.
MODEL_FROM = $(if $(filter command line,$(origin RUN) $(origin CONFIG)),--run_dir $(RUN))

translate: $(STAMP)
	$(PY) $(SRC) translate $(MODEL_FROM) $(if $(TEXT),"$$TEXT") $(ARGS)

evaluate: $(STAMP)
	$(PY) $(SRC) evaluate $(MODEL_FROM) $(ARGS)

# The run in RUN as a model folder, models/<run>; ARGS=--score records its test BLEU.
export: $(STAMP)
	$(PY) $(SRC) export --run_dir $(RUN) $(ARGS)

bench: $(STAMP)
	$(PY) benchmarks/bench.py $(ARGS)

# With the machine's own torch: .venv's python where there is one, else python3 (or
# GPU_PY=...); it needs only torch. ARGS='--data DIR' names the carried iwslt14 files
# (README, GPUs: what to carry).
GPU_PY ?= $(if $(wildcard $(PY)),$(PY),$(PYTHON_SYSTEM))
gpu-check:
	$(GPU_PY) benchmarks/gpu_check.py $(ARGS)

table3: $(STAMP)
	$(PY) benchmarks/table3.py $(ARGS)

# The headline preset with other seeds (benchmarks/seeds.py): its spread.
seeds: $(STAMP)
	$(PY) benchmarks/seeds.py $(ARGS)

clean:
	rm -rf $(VENV) runs build .pytest_cache site web/node_modules
