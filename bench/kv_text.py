"""Evaluation text for bench/kv.py and tests/kv/test_quality.py, written for this project.

EVAL_TEXT is original English prose (no downloads, nothing the model could have memorised
verbatim), several registers in a row: narrative, explanation, instructions, a letter,
dialogue. It tokenizes to a little over 2,000 tokens with the SmolLM2 tokenizer.
PROMPTS are the starts of greedy continuations for the agreement measurement.
"""

RAW_TEXT = """\
The town of Harlow Bridge grew up where an old road crossed a slow brown river. For most of
its history it was not much more than an inn, a smithy, a chapel and a row of cottages whose
gardens ran down to the water. Travellers stopped because they had to: the ford was
dangerous after rain, and the ferryman kept hours that suited himself rather than anyone
else. When the first stone bridge was finished, the ferryman lost his living, but the inn
doubled in size within ten years, and the market that had once been held twice a year began
to meet every Thursday.

The market is the reason the town still exists. Farmers from the hills brought wool, cheese
and cattle; merchants from the coast brought salt, cloth and news. People who came to sell
stayed to buy, and people who came to buy stayed the night. A second inn opened, then a
bank, then a small school in a building that had been a grain store. The school had one
room, one stove and one teacher, who was paid partly in money and partly in firewood. Her
name was Agnes Thorne, and the register she kept for forty-one years survives in the county
archive, with the names of more than two thousand children written in her narrow, careful
hand.

Change came slowly and then all at once. The railway reached the valley in the spring of
one year and the town had a station by the autumn of the next. Within a decade the cattle
no longer walked to market; they travelled in wagons, and the drovers who had filled the
inns on Wednesday nights found other work or moved away. The river, which had been the
reason for the town, became something people crossed without noticing. Today the old bridge
carries only pedestrians and the occasional delivery van, and the ford is a quiet stretch
of shallow water where children look for smooth stones.

Why do bicycles stay upright? The question sounds simple, and for a long time people assumed
that the answer was the gyroscopic effect of the spinning wheels. A spinning wheel does
resist being tilted, but experiments with bicycles whose wheels had extra, counter-rotating
wheels attached showed that the effect is small. Such bicycles can still be ridden, and some
of them even balance themselves when pushed along without a rider.

The more important part of the answer lies in the geometry of the front fork. The front
wheel touches the ground slightly behind the point where the steering axis meets the road.
This distance, called the trail, means that when the bicycle leans to one side, the front
wheel tends to turn in the same direction. Turning into the lean moves the wheels back
underneath the centre of mass, and the bicycle straightens up. A rider does the same thing
without thinking: to stop falling to the left, you steer slightly to the left. Balance on
a bicycle is not a matter of staying still but of making many small corrections, most of
them too small to notice.

Speed matters as well. At walking pace the corrections have to be large and quick, which is
why a slow bicycle wobbles. Above a certain speed the self-correcting effects become strong
enough that a well-designed bicycle will ride in a straight line with no hands on the bars.
Above a higher speed the same bicycle may start to weave, and the rider has to hold the bars
firmly again. Engineers who design bicycles try to place that upper limit well above any
speed the bicycle is likely to reach.

If you want to grow tomatoes in a small garden, start earlier than seems reasonable. The
seeds need warmth to sprout, so sow them indoors on a sunny windowsill about eight weeks
before the last frost is expected. Use small pots and fresh compost, and keep the soil damp
but not wet. When the seedlings have two pairs of true leaves, move each one into a larger
pot and bury the stem a little deeper than before; tomatoes grow new roots along any part
of the stem that is covered.

Before planting them outside, harden the young plants off. Put them outdoors for an hour
on the first warm day, then for a few hours, then for a whole day, and finally leave them
out overnight. A plant that goes straight from a windowsill into a cold bed will sulk for
weeks. Choose the sunniest spot you have, give each plant a strong stake, and tie the stem
loosely as it grows. Water at the base rather than over the leaves, and water deeply twice
a week rather than lightly every day, so that the roots grow down instead of staying near
the surface.

Most varieties grow side shoots in the angle between the main stem and each leaf. Pinch
these out while they are small, so that the plant puts its energy into fruit rather than
leaves. When the plant has set four or five trusses of flowers, cut off the top of the main
stem. The fruit that has already formed will then ripen before the cold weather returns.

Dear Thomas,

Thank you for your letter and for the photographs of the harbour. I had forgotten how
bright the boats look in the morning, before the sea mist has lifted. You asked whether I
would come back for the summer, and I have thought about it more than I expected to. The
honest answer is that I would like to, but I am not sure I can. The work here has become
more interesting since the new laboratory opened, and I have promised to help train the
students who arrive in July.

Still, I could manage two weeks in August, if the spare room is free. I would like to walk
the cliff path again, all the way to the lighthouse and back, and to eat fish that was
caught the same morning. I would also like to see your workshop. You describe the boat you
are building as if it were a person, which makes me think it must be nearly finished.
Please tell me what colour you have chosen for the hull. I have a feeling it will be blue.

With love, and with thanks for the jar of honey, which did not survive the journey quite as
well as the letter did,

Ruth

The tide rises and falls twice a day on most coasts, and the reason is not only that the
Moon pulls on the sea. The Moon pulls on the whole Earth, but it pulls more strongly on the
side that faces it and less strongly on the far side. The water on the near side is drawn
towards the Moon a little more than the solid Earth beneath it, and the solid Earth is drawn
a little more than the water on the far side. The result is two bulges of water, one facing
the Moon and one facing away, and the Earth turns underneath both of them each day.

The Sun has the same effect, but because it is so much farther away, its tidal pull is less
than half as strong as the Moon's. When the Sun and the Moon are lined up, at new moon and
full moon, their effects add together and the tides are larger than usual. These are called
spring tides, although they have nothing to do with the season. When the Sun and the Moon
are at right angles to each other, their effects partly cancel, and the tides are smaller.
These are called neap tides.

Real coastlines make the picture more complicated. In narrow bays and estuaries the water
can pile up, and the difference between high and low tide may reach more than ten metres.
In some enclosed seas the tide is barely noticeable. The shape of the sea floor, the width
of the channel and the natural rhythm at which the water sloshes back and forth all change
the result, which is why tide tables are calculated separately for each harbour rather than
from a single rule.

"You are late," said the stationmaster, without looking up from his newspaper.

"The train was late," said Ivo. "I was on it."

"That is not the same thing. The train is always late. A sensible person takes that into
account." The stationmaster turned a page. "What do you want?"

"I am looking for a woman called Elena Marsh. I was told she used to work here."

The stationmaster put the newspaper down. For the first time he looked at Ivo properly, at
the dusty coat and the suitcase with the broken strap, and at the envelope that Ivo was
holding in both hands as if it might blow away. "She did work here," he said slowly. "She
sold tickets in that window for twenty years. She retired last spring. Who is asking?"

"Her nephew. She wrote to my mother every Christmas, and then the letters stopped. My mother
died in the winter, and she asked me to find her sister and give her this." He held out the
envelope, then seemed to think better of it and drew it back.

The stationmaster was quiet for a moment. Outside, a goods train rattled through without
stopping, and the windows of the little office shook in their frames. When it had passed, he
stood up, took his coat from the hook behind the door, and locked the ticket drawer.

"She lives at the top of the hill," he said. "The house with the green door and too many
cats. I will walk you there. It is not far, but the path is steep, and you look as if you
have been travelling for a long time."

A good way to learn a new skill is to practise it in short sessions spread over many days
rather than in one long session. Memory researchers call this the spacing effect, and it has
been observed in everything from learning vocabulary to playing the piano. After a break,
recalling what you learned takes a little effort, and that effort seems to be what makes the
memory stronger. Long sessions feel more productive because the material stays fresh the
whole time, but much of what is learned that way fades quickly.

Testing yourself helps for a similar reason. Reading a chapter twice feels like studying,
but trying to write down what the chapter said, without looking, is more effective. The
attempt shows you which parts you do not yet know, and the act of retrieving the parts you do
know makes them easier to retrieve the next time. Mistakes made during practice are useful
too, as long as you find out what the correct answer was soon afterwards.

Finally, mix different kinds of problems together instead of practising one kind at a time.
A student who solves ten problems about fractions and then ten about percentages will do
well on the day, but a student who solves them in a mixed order has to decide each time
which method to use. That decision is exactly what a real test, or real life, will demand.
"""



def _reflow(text: str) -> str:
    """Join the lines of each paragraph: the source is wrapped for reading, the model should
    see prose as it is usually written, one line per paragraph."""
    return "\n\n".join(" ".join(p.split("\n")) for p in text.strip().split("\n\n")) + "\n"


EVAL_TEXT = _reflow(RAW_TEXT)

# Starts of greedy continuations: different registers, none taken from EVAL_TEXT.
PROMPTS = [
    "The old clock in the hallway had stopped at a quarter past three, and nobody in the house",
    "To make a simple vegetable soup, you will need",
    "The main reason that leaves change colour in the autumn is",
    "Once upon a time, in a village at the edge of a great forest, there lived",
    "def is_prime(n):\n    \"\"\"Return True if n is a prime number.\"\"\"\n",
    "Here are five tips for getting a better night's sleep:\n1.",
    "The history of the printing press begins in the fifteenth century, when",
    "Q: What is the difference between weather and climate?\nA:",
    "Dear Sir or Madam,\n\nI am writing to complain about",
    "Water boils at a lower temperature on a mountain because",
]
