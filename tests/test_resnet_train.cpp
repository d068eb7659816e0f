int dummy_resnet_train;
