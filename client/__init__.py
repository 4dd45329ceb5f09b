"""delaymq.client: producers and consumers, for trio and for plain blocking code.

Trio::

    async with open_producer("127.0.0.1:20880") as producer:
        await producer.send("orders", b"now")
        await producer.send("orders", b"in 90 s", delay=90)

    async with open_consumer("127.0.0.1:20880", "orders", group="billing") as consumer:
        async for message in consumer:
            await message.ack()

Blocking (the trio clients on a loop thread of their own: same options, defaults, errors)::

    with BlockingProducer("127.0.0.1:20880") as producer:
        producer.send("orders", b"now")
    with BlockingConsumer("127.0.0.1:20880", "orders", group="billing") as consumer:
        for message in consumer.messages(timeout=5):
            consumer.ack(message)

Errors: ``LocalProtocolError`` (a message breaks a limit; nothing was sent),
``PeerError`` (a server refused; ``code``, ``field``, ``limit``),
``NoRouteError`` / ``CallFailed`` (no group could take a request; ``CallTimedOut``
when retries went on for ``send_timeout``),
``ConsumerFailed`` (a server refused a consumer's pulls for good).
"""

from delaymq.client.blocking import BlockingConsumer, BlockingProducer
from delaymq.client.consumer import Consumer, ConsumerFailed, open_consumer
from delaymq.client.delivery import ConsumerStatistics, ReceivedMessage
from delaymq.client.messages import SentId
from delaymq.client.producer import Producer, ProducerStatistics, open_producer
from delaymq.client.routes import CallFailed, CallTimedOut, NoRouteError, RouteError
from delaymq.client.scheduled import MessageState
from delaymq.net.connection import TransportError
from delaymq.net.limits import Limits
from delaymq.protocol.errors import LocalProtocolError, PeerError, ProtocolError, RemoteProtocolError
from delaymq.protocol.records import Message

__all__ = [
    "BlockingConsumer",
    "BlockingProducer",
    "CallFailed",
    "CallTimedOut",
    "Consumer",
    "ConsumerFailed",
    "ConsumerStatistics",
    "Limits",
    "LocalProtocolError",
    "Message",
    "MessageState",
    "NoRouteError",
    "PeerError",
    "Producer",
    "ProducerStatistics",
    "ProtocolError",
    "ReceivedMessage",
    "RemoteProtocolError",
    "RouteError",
    "SentId",
    "TransportError",
    "open_consumer",
    "open_producer",
]
