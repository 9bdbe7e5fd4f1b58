# The nn suite: layers and gradient checks (test_nn.cpp), training pieces (test_nn_train.cpp),
# the same on a GPU (test_nn_cuda.cpp, skipped without one).
dp_add_test(test_nn SOURCES test_nn_activations.cpp test_nn.cpp test_nn_train.cpp test_nn_checkpoint.cpp
            test_nn_cuda.cpp test_nn_gpt.cpp test_nn_llama.cpp test_nn_optim_groups.cpp
            test_nn_optim_scalars.cpp test_nn_autograd.cpp test_nn_recompute.cpp
            test_nn_compute_copy.cpp)
# The training state (safetensors): bit-exact resume on one device and through DP.
dp_add_test(test_train_state SOURCES test_train_state.cpp LIBS dp_engine)
target_compile_definitions(test_train_state PRIVATE DP_SOURCE_DIR="${PROJECT_SOURCE_DIR}")
