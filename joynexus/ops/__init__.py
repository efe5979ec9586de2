"""Operations: process supervision of a deployment on a host (`joynexus up / down / status`)."""
