if(TARGET train_mnist)
  dp_add_test(test_samples SOURCES test_samples.cpp LIBS nlohmann_json::nlohmann_json dp_distributed)
  target_compile_definitions(test_samples PRIVATE DP_TRAIN_MNIST_PATH="$<TARGET_FILE:train_mnist>")
  add_dependencies(test_samples train_mnist)
endif()

# samples/compare_my_model: a user's own model through dp_bench's library, DP and DDP on CPU
# devices, with the same report (both modes follow one loss curve: equal final losses).
if(TARGET compare_my_model)
  add_test(NAME "samples.compare_my_model: DP and DDP on a user-defined model, same report"
           COMMAND $<TARGET_FILE:compare_my_model> --device cpu --gpus 2 --mode both --steps 4
                   --warmup 1 --batch 24 --repeat 2)
  set_tests_properties("samples.compare_my_model: DP and DDP on a user-defined model, same report"
    PROPERTIES TIMEOUT 120
    PASS_REGULAR_EXPRESSION "dp_bench: model residual_mlp \\(23910 parameters.*dp      2      24.*dp-hook 2      24.*ddp     2      24.*hook    2      24.*dp-hook: DP with the workload's comm hook powersgd-r4[^\n]*\n dp-hook  1[^\n]*\n dp-hook  2   bytes moved per step \\(the weights' copies, and the gradients: the hook's or the sums'\\) 105944 against 192048 \\(1.8x fewer\\).*hook: DDP with the workload's comm hook powersgd-r4.*verdict: residual_mlp, batch 24, 2 devices here \\(time-sliced\\)")
  add_test(NAME "samples.compare_my_model: refuses --model, which the workload replaces"
           COMMAND $<TARGET_FILE:compare_my_model> --device cpu --model cnn)
  set_tests_properties("samples.compare_my_model: refuses --model, which the workload replaces"
    PROPERTIES TIMEOUT 30
    PASS_REGULAR_EXPRESSION "--model: 'cnn' is not used: this program trains residual_mlp")
  # --sync-bn on a workload whose model has no BatchNorm did nothing, and said nothing.
  add_test(NAME "samples.compare_my_model: refuses --sync-bn, its model having no BatchNorm"
           COMMAND $<TARGET_FILE:compare_my_model> --device cpu --gpus 2 --mode dp --sync-bn)
  set_tests_properties("samples.compare_my_model: refuses --sync-bn, its model having no BatchNorm"
    PROPERTIES TIMEOUT 30
    PASS_REGULAR_EXPRESSION "--sync-bn with the workload residual_mlp: its model has no BatchNorm layer, so there is nothing to sync; drop --sync-bn")
  # The workload's own optimizer (AdamW with parameter groups) and clipping: --optim is refused,
  # and every mode and device count follows one loss curve under that recipe.
  add_test(NAME "samples.compare_my_model: its own optimizer, --optim refused"
           COMMAND $<TARGET_FILE:compare_my_model> --device cpu --optim sgd)
  set_tests_properties("samples.compare_my_model: its own optimizer, --optim refused"
    PROPERTIES TIMEOUT 30
    PASS_REGULAR_EXPRESSION "--optim: 'sgd' is not used: residual_mlp trains with its own optimizer \\(adamw\\+groups\\)")
  # The parameter server runs the built-in models only: a workload's --help offers neither its
  # mode nor its flags, and given they are refused by name.
  add_test(NAME "samples.compare_my_model: --mode ps and its flags are neither offered nor taken"
           COMMAND sh -c "$<TARGET_FILE:compare_my_model> --help | grep -c -e 'ps (parameter' -e --max-staleness -e --staleness-lr; $<TARGET_FILE:compare_my_model> --device cpu --mode ps 2>&1; $<TARGET_FILE:compare_my_model> --device cpu --max-staleness 1 2>&1")
  set_tests_properties("samples.compare_my_model: --mode ps and its flags are neither offered nor taken"
    PROPERTIES TIMEOUT 30
    PASS_REGULAR_EXPRESSION "^0
.*--mode: ps not in .*--max-staleness: is the parameter server's \\(--mode ps\\), which runs dp_bench's built-in models only; residual_mlp trains")
  # The four runs' final losses (dp and ddp, 1 and 2 devices) are one value: uniq counts 4.
  add_test(NAME "samples.compare_my_model: DP and DDP follow one loss curve under its recipe"
           COMMAND sh -c "$<TARGET_FILE:compare_my_model> --device cpu --gpus 2 --mode both --steps 4 --warmup 1 --batch 24 2>&1 | grep -v 'hook N=' | grep -o 'N=[12]: [0-9.]* ms/step, final loss [0-9.]*' | sed 's/.*final/final/' | sort | uniq -c")
  set_tests_properties("samples.compare_my_model: DP and DDP follow one loss curve under its recipe"
    PROPERTIES TIMEOUT 120 PASS_REGULAR_EXPRESSION "^ *4 final loss [0-9.]+\n$")
  # The workload's comm hook (PowerSGD): its DDP runs, graphed (the hook between the two captured
  # segments) and not, at 1 and 2 ranks, end on one loss: uniq counts 4.
  add_test(NAME "samples.compare_my_model: the comm hook's runs, graphs on and off, follow one loss curve"
           COMMAND sh -c "for g in on off; do $<TARGET_FILE:compare_my_model> --device cpu --gpus 2 --mode ddp --steps 6 --warmup 1 --batch 24 --cuda-graphs $g 2>&1 | grep -o 'hook N=[12]: [0-9.]* ms/step, final loss [0-9.]*'; done | sed 's/.*final/final/' | sort | uniq -c")
  set_tests_properties("samples.compare_my_model: the comm hook's runs, graphs on and off, follow one loss curve"
    PROPERTIES TIMEOUT 120 PASS_REGULAR_EXPRESSION "^ *4 final loss [0-9.]+\n$")
  # The hook under DP ("dp-hook": each device a rank of an in-process group) and under DDP (a
  # process per rank) trains one loss curve at 2 devices: uniq counts 2.
  add_test(NAME "samples.compare_my_model: the comm hook under DP and under DDP ends on one loss"
           COMMAND sh -c "$<TARGET_FILE:compare_my_model> --device cpu --gpus 2 --mode both --baseline 0 --steps 6 --warmup 1 --batch 24 2>&1 | grep -o 'hook N=2: [0-9.]* ms/step, final loss [0-9.]*' | sed 's/.*final/final/' | sort | uniq -c")
  set_tests_properties("samples.compare_my_model: the comm hook under DP and under DDP ends on one loss"
    PROPERTIES TIMEOUT 120 PASS_REGULAR_EXPRESSION "^ *2 final loss [0-9.]+\n$")
  # The hook under ZeRO-1 overlapped (--zero-overlap: the buckets meet through the hook, each rank
  # steps its shard) ends on the hook's own loss at 2 ranks (uniq counts 2), and each rank holds
  # half of AdamW's state (8P bytes over 2).
  add_test(NAME "samples.compare_my_model: the comm hook under ZeRO-1 overlapped ends on the hook's loss"
           COMMAND sh -c "{ $<TARGET_FILE:compare_my_model> --device cpu --gpus 2 --mode ddp --baseline 0 --steps 6 --warmup 1 --batch 24; $<TARGET_FILE:compare_my_model> --device cpu --gpus 2 --mode ddp --baseline 0 --steps 6 --warmup 1 --batch 24 --zero 1 --zero-overlap; } 2>&1 | grep -o 'hook N=2: [0-9.]* ms/step, final loss [0-9.]*' | sed 's/.*final/final/' | sort | uniq -c")
  set_tests_properties("samples.compare_my_model: the comm hook under ZeRO-1 overlapped ends on the hook's loss"
    PROPERTIES TIMEOUT 120 PASS_REGULAR_EXPRESSION "^ *2 final loss [0-9.]+\n$")
  add_test(NAME "samples.compare_my_model: the comm hook under ZeRO-1 overlapped holds half the state"
           COMMAND $<TARGET_FILE:compare_my_model> --device cpu --gpus 2 --mode ddp --baseline 0
                   --steps 2 --warmup 1 --batch 24 --zero 1 --zero-overlap)
  set_tests_properties("samples.compare_my_model: the comm hook under ZeRO-1 overlapped holds half the state"
    PROPERTIES TIMEOUT 120
    PASS_REGULAR_EXPRESSION " hook  2 adamw\\+groups zero-1 overlapped: 0.09 0.09   model: 4P \\+ 4P \\+ 8P/2 = 0.27 \\(state 0.09\\)")
  # --mode hybrid: the hook takes the sums over nodes ("hybrid-hook" rows beside hybrid's, one
  # run each), its bytes against the built-in sum's (PowerSGD's P and Q, and 8 bytes of metrics).
  add_test(NAME "samples.compare_my_model: the comm hook over hybrid's nodes, bytes against the sum"
           COMMAND $<TARGET_FILE:compare_my_model> --device cpu --gpus 2 --mode hybrid --steps 4
                   --warmup 1 --batch 24)
  set_tests_properties("samples.compare_my_model: the comm hook over hybrid's nodes, bytes against the sum"
    PROPERTIES TIMEOUT 120
    PASS_REGULAR_EXPRESSION " mode        N   batch.*\n hybrid      4      24 [^\n]*\n hybrid-hook 4      24 [^\n]*\n\n.*hybrid-hook: hybrid with the workload's comm hook powersgd-r4 in place of the sum over nodes.*\n hybrid-hook  4   bytes handed to the group per step 4968 against 96032 \\(19.3x fewer\\)[^\n]*\n\n")
  # --help lists only the flags the workload takes (the built-in models' are left out).
  add_test(NAME "samples.compare_my_model: --help leaves out the built-in models' flags"
           COMMAND $<TARGET_FILE:compare_my_model> --help)
  set_tests_properties("samples.compare_my_model: --help leaves out the built-in models' flags"
    PROPERTIES TIMEOUT 30 PASS_REGULAR_EXPRESSION "--gpus"
    FAIL_REGULAR_EXPRESSION "--model|--gpt-config|--seq |--dropout|--peak-tflops|--optim")
endif()

# samples/train_text: a byte-level GPT on fortunes-min beats a bigram model; DP and resume.
if(TARGET train_text)
  dp_add_test(test_train_text SOURCES test_train_text.cpp LIBS dp_data dp_distributed)
  target_compile_definitions(test_train_text PRIVATE DP_TRAIN_TEXT_PATH="$<TARGET_FILE:train_text>")
  add_dependencies(test_train_text train_text)
endif()

# samples/custom_layer: a layer written with autograd equals the hand-written one, and both pass
# gradcheck (alone and in a network).
if(TARGET custom_layer)
  add_test(NAME "samples.custom_layer: composed and hand-written layers agree and pass gradcheck"
           COMMAND $<TARGET_FILE:custom_layer>)
  set_tests_properties("samples.custom_layer: composed and hand-written layers agree and pass gradcheck"
    PROPERTIES TIMEOUT 60
    PASS_REGULAR_EXPRESSION "composed vs hand-written parameter gradients: max \\|diff\\| [0-9.e-]+.*gradcheck ComposedGatedLinear.*gradcheck GatedLinear.*gradcheck Sequential"
    FAIL_REGULAR_EXPRESSION "FAIL")
  add_test(NAME "samples.custom_layer: an argument is refused, naming it" COMMAND $<TARGET_FILE:custom_layer> --steps 3)
  set_tests_properties("samples.custom_layer: an argument is refused, naming it"
    PROPERTIES TIMEOUT 30 PASS_REGULAR_EXPRESSION "custom_layer: '--steps' is not an argument")
endif()
