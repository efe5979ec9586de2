"""The wire protocol shared by the tenant API server and its client: tensors on the wire and the
request / response models."""
