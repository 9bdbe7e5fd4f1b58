# The nn suite: layers and gradient checks (test_nn.cpp), training pieces (test_nn_train.cpp).
dp_add_test(test_nn SOURCES test_nn.cpp test_nn_train.cpp)
