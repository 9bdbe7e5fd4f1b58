# The nn suite: layers and gradient checks (test_nn.cpp), training pieces (test_nn_train.cpp),
# the same on a GPU (test_nn_cuda.cpp, skipped without one).
dp_add_test(test_nn SOURCES test_nn.cpp test_nn_train.cpp test_nn_checkpoint.cpp test_nn_cuda.cpp)
